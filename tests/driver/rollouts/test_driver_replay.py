"""driver.rollouts.replay: which groups the buffer keeps and serves, and that replayed groups make correct
rows in a batch of another width."""

import io
import math
import statistics

import pytest
import torch

from driver.data.prompts import Prompt
from driver.data.records import Group, Sample, Span
from driver.policy.logprobs import pack
from driver.rewards.advantages import combine_rewards
from driver.rollouts.batch import batch_from_groups
from driver.rollouts.replay import ReplayBuffer, replay_score

PAD_ID = 151643  # Qwen2's pad token: prompts hold it (and token 0) as real tokens
SIGNAL = [1.0, 0.0, 0.0, 1.0]  # a group with signal: score = sum |r - mean| = 2 (the std cancels)
NO_SIGNAL = [1.0, 1.0, 1.0, 1.0]


def make_group(group_id: int, rewards: list[float], version: int = 0, lengths: list[int] | None = None,
               prompt_ids: list[int] | None = None) -> Group:
    """A scored group: rewards [G] (NaN: the reward function returned None), completions of `lengths`."""
    lengths = lengths or [2] * len(rewards)
    prompt_ids = prompt_ids or [PAD_ID, 0, 11 + group_id]
    samples = [Sample(token_ids=[100 * group_id + 10 * row + t for t in range(length)],
                      logprobs=[-0.5 - 0.01 * (100 * group_id + 10 * row + t) for t in range(length)],
                      finish_reason="stop", spans=[Span(0, length, version)])
               for row, length in enumerate(lengths)]
    group = Group(group_id=group_id, prompt=Prompt(group_id, f"prompt {group_id}", prompt_ids, {"answer": "4"}),
                  samples=samples, rewards=torch.tensor(rewards).unsqueeze(1))
    group.total, group.advantages, _ = combine_rewards(group.rewards, torch.ones(1), len(rewards),
                                                       "sum_then_normalize", "group")
    return group


def assert_same(actual, expected, where="state"):
    """Equal structure, types and values; tensors equal bit for bit (NaN matches NaN)."""
    assert type(actual) is type(expected), where
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual.isnan(), expected.isnan()), where
        assert torch.equal(actual.nan_to_num(), expected.nan_to_num()), where
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected or (actual != actual and expected != expected), where


def test_score_is_the_sum_of_absolute_advantages_times_the_reward_std():
    group = make_group(0, [0.0, 0.25, 1.0])
    expected = group.advantages.abs().sum().item() * statistics.stdev([0.0, 0.25, 1.0])
    assert replay_score(group) == pytest.approx(expected, rel=1e-6)
    assert replay_score(make_group(1, SIGNAL)) == pytest.approx(2.0, rel=1e-3)  # eps in the advantages' divisor


@pytest.mark.parametrize("rewards", [NO_SIGNAL, [0.1, 0.1, 0.1], [math.nan] * 2])
def test_zero_signal_groups_score_exactly_zero(rewards):
    assert replay_score(make_group(0, rewards)) == 0.0


def test_nan_totals_are_left_out_of_the_std():
    group = make_group(0, [0.0, 1.0, 0.5])
    group.total = torch.tensor([math.nan, 0.0, 1.0])
    assert replay_score(group) == pytest.approx(group.advantages.abs().sum().item() * math.sqrt(0.5), rel=1e-6)
    group.total = torch.tensor([math.nan, 0.3, math.nan])
    assert replay_score(group) == 0.0


def test_keeps_the_top_capacity_groups_by_score():
    buffer = ReplayBuffer(capacity=2, max_age=10)
    groups = [make_group(0, [0.0, 0.1]), make_group(1, [0.0, 1.0]), make_group(2, [0.0, 0.5])]
    assert buffer.add(groups, step=0) == 2
    assert [group.group_id for group in buffer.take(5, step=0)] == [1, 2]
    assert buffer.metrics()["replay/evicted_full"] == 1


def test_equal_scores_evict_the_older_group_and_serve_the_newer_first():
    buffer = ReplayBuffer(capacity=2, max_age=10)
    buffer.add([make_group(7, SIGNAL), make_group(3, SIGNAL)], step=0)
    assert buffer.add([make_group(5, SIGNAL)], step=0) == 1  # group 3 is the oldest of the equals
    assert [group.group_id for group in buffer.take(2, step=0)] == [7, 5]


def test_zero_signal_and_replayed_groups_are_not_added():
    buffer = ReplayBuffer(capacity=4, max_age=10)
    replayed = make_group(1, SIGNAL)
    replayed.replayed = True
    assert buffer.add([make_group(0, NO_SIGNAL), replayed, make_group(2, SIGNAL)], step=0) == 1
    assert len(buffer) == 1


def test_take_never_returns_a_group_older_than_max_age_and_counts_stale_evictions():
    buffer = ReplayBuffer(capacity=4, max_age=2)
    buffer.add([make_group(0, [0.0, 1.0], version=1), make_group(1, SIGNAL, version=3)], step=3)
    taken = buffer.take(4, step=4)  # ages 3 and 1: group 0 is evicted although it scores higher
    assert [group.group_id for group in taken] == [1]
    assert all(4 - group.version <= 2 for group in taken)
    assert buffer.metrics()["replay/evicted_stale"] == 1
    assert len(buffer) == 0


def test_a_group_already_too_old_when_offered_is_counted_stale_not_kept():
    buffer = ReplayBuffer(capacity=4, max_age=1)
    assert buffer.add([make_group(0, SIGNAL, version=0)], step=2) == 0
    assert buffer.metrics()["replay/evicted_stale"] == 1


def test_taken_groups_leave_the_buffer_as_replayed_copies():
    buffer = ReplayBuffer(capacity=4, max_age=10)
    stored = make_group(0, SIGNAL)
    advantages, token_ids = stored.advantages.clone(), list(stored.samples[0].token_ids)
    buffer.add([stored], step=0)
    stored.advantages.zero_()  # the caller's later edits do not reach the buffer
    stored.samples[0].token_ids.append(99)
    (taken,) = buffer.take(1, step=1)
    assert taken.replayed and not stored.replayed
    assert torch.equal(taken.advantages, advantages) and taken.samples[0].token_ids == token_ids
    taken.samples[1].logprobs.clear()  # nor do edits of the taken copy reach the caller's group
    assert len(stored.samples[1].logprobs) == 2
    assert len(buffer) == 0 and buffer.take(1, step=1) == []
    assert buffer.metrics()["replay/taken"] == 1


def test_capacity_zero_keeps_nothing():
    buffer = ReplayBuffer(capacity=0, max_age=10)
    assert buffer.add([make_group(0, SIGNAL)], step=0) == 0
    assert buffer.take(1, step=0) == []


def test_state_round_trips_through_torch_save_loaded_with_weights_only():
    buffer = ReplayBuffer(capacity=3, max_age=4)
    buffer.add([make_group(i, [0.0, 0.2 * i, math.nan], version=i, lengths=[1, i + 1, 3]) for i in range(1, 6)],
               step=5)
    buffer.take(1, step=5)
    saved = io.BytesIO()
    torch.save(buffer.state_dict(), saved)
    saved.seek(0)
    restored = ReplayBuffer(capacity=3, max_age=4)
    restored.load_state_dict(torch.load(saved, weights_only=True))
    assert_same(restored.state_dict(), buffer.state_dict())
    assert restored.metrics() == buffer.metrics()
    assert_same([vars(group) for group in restored.take(3, step=7)], [vars(group) for group in buffer.take(3, step=7)])


# Completion lengths of the groups generated this step, and of the replayed group joining them:
# wider than the new batch, narrower, and of the same width.
NEW_LENGTHS = [[3, 5], [4, 1]]
REPLAYED_LENGTHS = {"wider": [9, 2], "narrower": [1, 2], "same_width": [5, 5]}


@pytest.mark.parametrize("width", REPLAYED_LENGTHS)
def test_replayed_rows_join_a_batch_of_another_width_correctly(width):
    old = make_group(1, SIGNAL[:2], version=0, lengths=REPLAYED_LENGTHS[width], prompt_ids=[0, PAD_ID, 7, 0])
    buffer = ReplayBuffer(capacity=1, max_age=3)
    buffer.add([old], step=1)
    new = [make_group(2 + i, SIGNAL[:2], version=2, lengths=lengths, prompt_ids=[PAD_ID] * i + [5, 0, 6])
           for i, lengths in enumerate(NEW_LENGTHS)]
    groups = new + buffer.take(1, step=3)
    assert [sample.logprobs for sample in groups[-1].samples] == [sample.logprobs for sample in old.samples]
    batch = batch_from_groups(groups)

    rows = [(group, sample) for group in groups for sample in group.samples]
    width_expected = max(len(sample.token_ids) for _, sample in rows)
    assert batch.sampling_logprobs.shape == batch.mask.shape == (len(rows), width_expected)
    assert batch.versions == [sample.version for _, sample in rows]
    for index, (group, sample) in enumerate(rows):
        length = len(sample.token_ids)
        assert batch.prompt_ids[index] == group.prompt.token_ids
        assert batch.completion_ids[index] == sample.token_ids
        assert batch.sampling_logprobs[index, :length].tolist() == torch.tensor(sample.logprobs).tolist()
        assert not batch.sampling_logprobs[index, length:].any()
        assert batch.mask[index].tolist() == [1.0] * length + [0.0] * (width_expected - length)

    packed = pack(batch.prompt_ids, batch.completion_ids)
    sequences = [group.prompt.token_ids + sample.token_ids for group, sample in rows]
    starts = packed.cu_seqlens.tolist()
    for index, sequence in enumerate(sequences):
        assert packed.input_ids[0, starts[index]:starts[index + 1]].tolist() == sequence
    flat = [token for sequence in sequences for token in sequence]
    assert packed.input_ids.shape == (1, len(flat))  # nothing inserted: pad ids and 0 only where they were
    assert packed.input_ids[0].tolist().count(PAD_ID) == flat.count(PAD_ID) > 0
    assert packed.input_ids[0].tolist().count(0) == flat.count(0) > 0


BAD_ARGUMENTS = [
    (lambda: ReplayBuffer(capacity=-1, max_age=1), "capacity"),
    (lambda: ReplayBuffer(capacity=1, max_age=-1), "max_age"),
    (lambda: ReplayBuffer(capacity=1, max_age=1).take(-1, step=0), "count"),
    (lambda: replay_score(Group(0, Prompt(0, "p", [1]), [])), "advantages"),
]


@pytest.mark.parametrize("call,argument", BAD_ARGUMENTS, ids=[argument for _, argument in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_proportional_sampling_draws_in_proportion_to_the_score_and_keeps_the_groups():
    """axolotl's draw: P(group) = its score / the buffer's total score (group 1's rewards spread three times
    as far as group 0's). Over 4000 steps group 1's frequency is within 3 standard errors of that; the
    drawn groups stay in the buffer, as copies marked replayed."""
    low, high = make_group(0, [0.0, 1.0, 0.0, 1.0]), make_group(1, [0.0, 3.0, 0.0, 3.0])
    expected = replay_score(high) / (replay_score(low) + replay_score(high))
    buffer = ReplayBuffer(capacity=4, max_age=10_000, sampling="proportional", seed=5)
    buffer.add([low, high], step=0)
    steps = 4000
    drawn = [buffer.take(1, step=step)[0] for step in range(steps)]
    frequency = sum(group.group_id == 1 for group in drawn) / steps
    assert abs(frequency - expected) < 3 * math.sqrt(expected * (1 - expected) / steps)
    assert len(buffer) == 2 and all(group.replayed for group in drawn)
    drawn[0].samples.clear()  # a copy: the buffer's group keeps its samples
    assert all(len(group.samples) == 4 for group in buffer.take(2, step=0))


def test_proportional_sampling_is_seeded_by_the_step_and_never_draws_a_group_twice():
    groups = [make_group(group_id, SIGNAL) for group_id in range(3)]
    first = ReplayBuffer(capacity=4, max_age=10, sampling="proportional", seed=1)
    again = ReplayBuffer(capacity=4, max_age=10, sampling="proportional", seed=1)
    first.add(groups, step=0)
    again.load_state_dict(first.state_dict())  # a resumed run draws what the straight one drew
    for step in range(5):
        ids = [group.group_id for group in first.take(2, step=step)]
        assert ids == [group.group_id for group in again.take(2, step=step)]
        assert len(set(ids)) == 2
    assert sorted(group.group_id for group in first.take(10, step=9)) == [0, 1, 2]  # at most every group once


def test_an_unknown_replay_sampling_is_refused():
    with pytest.raises(ValueError, match="sampling must be one of"):
        ReplayBuffer(capacity=2, max_age=1, sampling="uniform")
