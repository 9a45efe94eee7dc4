"""algo.dynamic_sampling (DAPO, driver/rollouts/dynamic_sampling.py) through the synchronous pipeline, against
a list-based simulation of the rule on the prompt stream: which prompts are drawn and trained on, the extra
rounds and their bound, the metrics; advantages against hand-written estimators over exactly the kept groups.

With tests/async_fakes.py and 4 samples per group, a group has signal exactly when its prompt lacks "flat":
length_parity gives 0 to every sample of a flat prompt, and FakeGenerator's natural lengths (3, 5, 2, 4)
cycle through all four samples of any other group, so two rewards are 1 and two are 0.
"""

import itertools
import json
import math

import pytest
import torch
from pydantic import ValidationError

import driver.rollouts.feed
from driver.config import Config
from driver.data.prompts import Prompt, PromptSource
from driver.data.records import Group, Sample, Span
from driver.rewards.group_scorer import GroupScorer
from driver.rollouts.dynamic_sampling import has_signal
from driver.rollouts.producer import Producer
from tests.async_fakes import COMPLETION_BASE, FakeGenerator, FakeTokenizer, make_rollouts, run_steps

GROUP_SIZE = 4
# Signal is sparse in places (runs of flat prompts), dense in others, and the data cycles (epochs).
PROMPTS = ["alpha", "flat 1", "flat 2", "flat 3", "bravo", "flat 4", "charlie", "delta", "flat 5", "flat 6",
           "flat 7", "flat 8", "flat 9", "flat 10", "echo", "foxtrot", "flat 11", "golf", "hotel", "india"]


def make_config(tmp_path, prompts=PROMPTS, **sections) -> Config:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    base = {"data": {"source": str(data), "shuffle": False},
            "rewards": {"functions": [{"path": "tests.async_fakes.length_parity"}]},
            "algo": {"num_generations": GROUP_SIZE, "dynamic_sampling": True},
            "train": {"prompts_per_step": 2, "micro_batch_size": 4, "steps": 20},
            "rollout": {"verify_sync": False, "sampling": {"max_tokens": 10}},
            "logging": {"output_dir": str(tmp_path / "out")}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return Config.model_validate(base)


def simulate(prompts, quota, max_rounds, steps):
    """The rule on the prompt stream, per step: (prompts trained on, extra rounds, groups generated, groups
    with signal); every prompt drawn, in order. A step without any signal trains on its first quota."""
    stream, drawn_all, results = itertools.cycle(prompts), [], []
    for _ in range(steps):
        drawn, rounds = [next(stream) for _ in range(quota)], 0
        while True:
            signal = [prompt for prompt in drawn if "flat" not in prompt]
            if len(signal) >= quota or rounds == max_rounds:
                break
            missing = quota - len(signal)
            count = min(quota, -(-missing * len(drawn) // len(signal))) if signal else quota
            drawn += [next(stream) for _ in range(count)]
            rounds += 1
        results.append((signal[:quota] or drawn[:quota], rounds, len(drawn), len(signal)))
        drawn_all += drawn
    return results, drawn_all


def trained_prompts(batch) -> list[str]:
    """The prompts of the step's own groups (the completions table: every row before filtering), in order."""
    return [row["prompt"] for row in batch.table[::GROUP_SIZE]]


def fresh_prompts(generator) -> list[list[int]]:
    return [request.token_ids for _, request in generator.requests if request.n == GROUP_SIZE]


CASES = [(2, 1), (2, 3), (3, 2), (4, 3), (5, 1)]  # (prompts_per_step, dynamic_sampling_max_rounds)
STEPS = 6


def test_the_cases_cover_every_outcome():
    outcomes = {(rounds > 0, min(with_signal, quota) == quota, with_signal > 0)
                for quota, max_rounds in CASES for _, rounds, _, with_signal in simulate(PROMPTS, quota, max_rounds,
                                                                                          STEPS)[0]}
    assert outcomes == {(False, True, True), (True, True, True), (True, False, True), (True, False, False)}


@pytest.mark.parametrize("quota, max_rounds", CASES)
def test_rounds_prompts_and_metrics_follow_the_rule(tmp_path, quota, max_rounds):
    steps = STEPS
    config = make_config(tmp_path, algo={"dynamic_sampling_max_rounds": max_rounds},
                         train={"prompts_per_step": quota})
    generator = FakeGenerator()
    rollouts = make_rollouts(config, generator)
    try:
        batches = run_steps(rollouts, steps)
    finally:
        rollouts.close()
    expected, drawn = simulate(PROMPTS, quota, max_rounds, steps)
    tokenizer = FakeTokenizer()
    assert fresh_prompts(generator) == [tokenizer(prompt).input_ids for prompt in drawn]  # none more, none fewer
    for batch, (prompts, rounds, generated, with_signal) in zip(batches, expected):
        assert trained_prompts(batch) == prompts
        kept = min(with_signal, quota)
        assert batch.metrics["dynamic_sampling/rounds"] == rounds <= max_rounds
        assert batch.metrics["dynamic_sampling/generated_groups"] == generated
        assert batch.metrics["dynamic_sampling/groups_with_signal"] == with_signal
        assert batch.metrics["dynamic_sampling/filled_fraction"] == kept / quota
        assert batch.metrics["rollout/rounds"] == rounds + 1  # one engine round per job without partial rollouts
        assert len(batch) == kept * GROUP_SIZE  # no row of a kept group has advantage 0 here
        assert batch.counts.num_sequences == len(prompts) * GROUP_SIZE
        assert all("flat" not in prompt for prompt, _, _ in batch.samples)


def test_a_step_without_any_signal_is_assembled_as_without_dynamic_sampling(tmp_path):
    config = make_config(tmp_path, prompts=[f"flat {i}" for i in range(10)], algo={"dynamic_sampling_max_rounds": 2})
    rollouts = make_rollouts(config)
    try:
        batch = rollouts.next_batch(0)
    finally:
        rollouts.close()
    assert trained_prompts(batch) == ["flat 0", "flat 1"]  # the first job's groups, all zero-signal: filtered out
    assert len(batch) == 0 and batch.counts.num_sequences == 2 * GROUP_SIZE
    assert batch.metrics["dynamic_sampling/generated_groups"] == 2 + 2 + 2
    assert batch.metrics["dynamic_sampling/filled_fraction"] == 0.0


def grouped(values, size=GROUP_SIZE):
    return [values[start:start + size] for start in range(0, len(values), size)]


def group_standardized(rewards, scale):
    """GRPO: (r - group mean) / (std + 1e-4), std unbiased, of the group or of the whole batch."""
    batch_std = torch.tensor(rewards).std().item()
    out = []
    for group in grouped(rewards):
        mean, std = sum(group) / len(group), torch.tensor(group).std().item()
        out += [(r - mean) / ((std if scale == "group" else batch_std) + 1e-4) for r in group]
    return out


def leave_one_out(rewards):
    return [r - (sum(group) - r) / (len(group) - 1) for group in grouped(rewards) for r in group]


def token_whitened(rewards, lengths):
    """REINFORCE++: each reward counted once per completion token; (r - mean) / sqrt(unbiased var + 1e-8)."""
    tokens = [r for r, n in zip(rewards, lengths) for _ in range(n)]
    mean = sum(tokens) / len(tokens)
    variance = sum((t - mean) ** 2 for t in tokens) / (len(tokens) - 1)
    return [(r - mean) / math.sqrt(variance + 1e-8) for r in rewards]


ESTIMATORS = {  # algo settings -> the advantages over the batch's rows, from (rewards, completion lengths)
    "grpo": ({}, lambda rewards, lengths: group_standardized(rewards, "group")),
    "grpo, scale_rewards batch": ({"scale_rewards": "batch"}, lambda rewards, lengths: group_standardized(rewards,
                                                                                                         "batch")),
    "rloo": ({"advantage_estimator": "rloo"}, lambda rewards, lengths: leave_one_out(rewards)),
    "reinforce_plus_plus": ({"advantage_estimator": "reinforce_plus_plus"}, token_whitened),
}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_advantages_are_the_estimator_over_exactly_the_kept_groups(tmp_path, estimator):
    settings, oracle = ESTIMATORS[estimator]
    # Completions of different lengths per group, and rewards that are not one pattern, for the batch statistics.
    config = make_config(tmp_path, algo={"zero_advantage": "keep", **settings}, train={"prompts_per_step": 3})
    rollouts = make_rollouts(config, FakeGenerator(lengths=(3, 5, 2, 4, 7, 6)))
    try:
        batch = rollouts.next_batch(0)
    finally:
        rollouts.close()
    assert batch.metrics["dynamic_sampling/rounds"] >= 1 and trained_prompts(batch) == ["alpha", "bravo", "charlie"]
    lengths = [len(completion) for completion in batch.completion_ids]
    rewards = [float((ids[0] - COMPLETION_BASE) % 2 == 0) for ids in batch.completion_ids]
    assert [reward for _, _, reward in batch.samples] == rewards
    torch.testing.assert_close(batch.advantages, torch.tensor(oracle(rewards, lengths)), atol=1e-5, rtol=1e-5)


def test_kl_in_reward_penalizes_only_the_kept_groups_and_selection_reads_the_task_reward(tmp_path, monkeypatch):
    penalized = []

    def fake_kl_penalties(config, policy, groups):  # a KL spread that would give every flat group "signal"
        penalized.append([group.prompt.text for group in groups])
        for group in groups:
            group.kl_penalty = -0.01 * torch.arange(len(group.samples), dtype=torch.float32)

    monkeypatch.setattr(driver.rollouts.feed, "set_kl_penalties", fake_kl_penalties)
    config = make_config(tmp_path, algo={"kl_in_reward": True, "beta": 0.1})
    rollouts = make_rollouts(config)
    try:
        batches = run_steps(rollouts, 3)
    finally:
        rollouts.close()
    expected, _ = simulate(PROMPTS, 2, config.algo.dynamic_sampling_max_rounds, 3)
    assert penalized == [prompts for prompts, *_ in expected] == [trained_prompts(batch) for batch in batches]
    for batch in batches:  # the penalty reached the advantages of the kept groups
        assert batch.metrics["rewards/kl_penalty/mean"] == pytest.approx(-0.015)


def test_places_the_rounds_leave_empty_are_refilled_from_the_replay_buffer(tmp_path):
    prompts = ["alpha", "bravo", "flat 1", "flat 2", "charlie", "delta", "flat 3", "flat 4", "echo", "flat 5"]
    config = make_config(tmp_path, prompts=prompts, algo={"dynamic_sampling_max_rounds": 1,
                                                          "replay_buffer_size": 8, "replay_max_age": 4})
    rollouts = make_rollouts(config)
    try:
        batches = run_steps(rollouts, 3)
    finally:
        rollouts.close()
    assert [trained_prompts(batch) for batch in batches] == [["alpha", "bravo"], ["charlie", "delta"], ["echo"]]
    last = batches[2]
    assert last.metrics["dynamic_sampling/filled_fraction"] == 0.5 and last.metrics["replay/replayed_groups"] == 1
    replayed_rows = [row for row, version in enumerate(last.versions) if version < 2]
    assert len(last) == 2 * GROUP_SIZE and replayed_rows == list(range(GROUP_SIZE, 2 * GROUP_SIZE))
    assert last.counts.num_sequences == 2 * GROUP_SIZE  # the kept group plus the replayed one


def test_dropped_groups_that_failed_entirely_are_still_rerolled(tmp_path):
    config = make_config(tmp_path, algo={"reroll_failed": True, "reroll_after": 0.5, "dynamic_sampling_max_rounds": 3},
                         train={"prompts_per_step": 2, "steps": 4})
    rollouts = make_rollouts(config)
    try:
        batch = rollouts.next_batch(0)
        queued = rollouts.reroll.metrics()["reroll/queued"]
    finally:
        rollouts.close()
    _, drawn = simulate(PROMPTS, 2, 3, 1)
    assert trained_prompts(batch) == ["alpha", "bravo"] and queued == sum("flat" in p for p in drawn) == 4


def test_a_checkpoint_loses_no_prompt(tmp_path):
    config = make_config(tmp_path, algo={"dynamic_sampling_max_rounds": 2})
    whole = make_rollouts(config)
    try:
        expected = [(b.prompt_ids, b.completion_ids) for b in run_steps(whole, 6)]
    finally:
        whole.close()
    first = make_rollouts(config)
    try:
        got = [(b.prompt_ids, b.completion_ids) for b in run_steps(first, 3)]
        path = tmp_path / "state.pt"
        torch.save(first.state_dict(), path)
    finally:
        first.close()
    resumed = make_rollouts(config, start_step=3, state=torch.load(path, weights_only=False))
    try:
        got += [(b.prompt_ids, b.completion_ids) for b in run_steps(resumed, 3, start=3)]
    finally:
        resumed.close()
    assert got == expected


def test_partial_rollouts_fill_the_step_and_keep_unfinished_groups_in_flight(tmp_path):
    config = make_config(tmp_path, rollout={"partial_rollout_tokens": 3, "max_staleness": 5},
                         algo={"dynamic_sampling_max_rounds": 4})
    rollouts = make_rollouts(config, FakeGenerator(lengths=(7, 2, 8, 3)))
    try:
        batches = run_steps(rollouts, 4)
        in_flight = len(rollouts.producer.in_flight) + len(rollouts.producer.ready)
    finally:
        rollouts.close()
    for batch in batches:
        assert batch.metrics["dynamic_sampling/filled_fraction"] == 1.0
        assert all("flat" not in prompt for prompt in trained_prompts(batch))
    assert in_flight > 0  # extra rounds leave long groups to be continued, as the first job does


def test_produce_makes_the_groups_asked_for_with_the_next_prompts(tmp_path):
    config = make_config(tmp_path)
    tokenizer = FakeTokenizer()
    producer = Producer(config, FakeGenerator(), PromptSource(config.data, tokenizer, 0), tokenizer)
    first = producer.produce(0, version=0)
    more = producer.produce(0, version=0, quota=3)
    assert [len(first.groups), len(more.groups)] == [2, 3]
    assert [g.group_id for g in first.groups + more.groups] == list(range(5))
    assert [g.prompt.text for g in first.groups + more.groups] == PROMPTS[:5]
    assert more.index == 0 and more.version == 0


def make_group(rewards: list[list[float]]) -> Group:
    samples = [Sample([COMPLETION_BASE + 1], [-0.1], "stop", [Span(0, 1, 0)]) for _ in rewards]
    return Group(group_id=0, prompt=Prompt(0, "p", [1], {}), samples=samples, rewards=torch.tensor(rewards))


@pytest.mark.parametrize("aggregation, weights, rewards, expected", [
    ("sum_then_normalize", [1.0, 1.0], [[1.0, 0.0], [0.0, 1.0]], False),  # the totals are equal
    ("sum_then_normalize", [1.0, 0.0], [[1.0, 0.0], [1.0, 1.0]], False),  # only a zero-weight function varies
    ("sum_then_normalize", [1.0, 0.0], [[1.0, 0.0], [0.0, 0.0]], True),
    ("sum_then_normalize", [1.0, 1.0], [[math.nan, math.nan], [1.0, 0.0], [1.0, 0.0]], False),  # NaN: unscored
    ("normalize_then_sum", [1.0, 1.0], [[1.0, 0.0], [0.0, 1.0]], False),  # the z-scores cancel
    ("normalize_then_sum", [1.0, 1.0], [[1.0, 0.0], [0.0, 2.0]], True),
])
def test_signal_is_a_non_zero_advantage_of_the_group_alone(tmp_path, aggregation, weights, rewards, expected):
    config = make_config(tmp_path, rewards={"aggregation": aggregation, "functions": [
        {"path": "tests.async_fakes.length_parity", "weight": weight, "name": f"f{index}"}
        for index, weight in enumerate(weights)]}, algo={"num_generations": len(rewards)})
    scorer = GroupScorer(config)
    try:
        group = make_group(rewards)
        assert has_signal(scorer, group) is expected
        assert group.total is not None and group.advantages is not None  # re-roll reads a dropped group's total
    finally:
        scorer.close()


@pytest.mark.parametrize("sections, message", [
    ({"rollout": {"async_prefetch": True}}, "turn off rollout.async_prefetch"),
    ({"algo": {"dynamic_sampling_max_rounds": 0}}, "greater than or equal to 1"),
])
def test_config_refuses_what_dynamic_sampling_cannot_work_with(tmp_path, sections, message):
    with pytest.raises(ValidationError, match=message):
        make_config(tmp_path, **sections)
    with pytest.raises(ValidationError, match="dynamic_sampling applies to grpo"):
        Config.model_validate({"algo": {"name": "ebft", "dynamic_sampling": True}})
