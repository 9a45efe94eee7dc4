"""Zero-advantage filtering on a real (tiny) policy: the filtered update equals the unfiltered one
(beta = 0), an all-zero batch makes no forward pass yet steps the optimizer the same, beta > 0
filters nothing, and the step's counts survive merge and extend_batch.

Only gradients, weights and the loss are compared: entropy, clip and importance-sampling metrics are
means over the micro-batches actually trained, so they change when rows are removed, by design.
"""

import copy
from dataclasses import replace

import pytest
import torch

import driver.update.step
from driver.config import Config
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import load_policy
from driver.rollouts.batch import RolloutBatch
from driver.rollouts.filtering import StepCounts, extend_batch, filter_zero_advantage, merge, step_counts
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import optimize

LENGTHS = [3, 5, 2, 4, 1, 6, 3, 2]
# Groups of 2: rows 0-1 and 4-5 are zero-signal groups, row 7 an exact zero in a mixed group (e.g. a
# normalize_then_sum cancellation). With micro-batches of 2 whole micro-batches empty out; with 3
# every micro-batch keeps some rows, not all.
ADVANTAGES = [0.0, 0.0, 0.9, -0.9, 0.0, 0.0, 1.3, 0.0]
KEPT_ROWS = [2, 3, 6]
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
ATOL, RTOL = 1e-6, 1e-4  # fp32: packing other rows together changes the summation order, nothing else
LR = 1e-4


def make_base_policy():
    """The tiny policy with a rank-4 adapter; also the base_policy of
    tests/driver/rollouts/test_driver_shard_batch.py."""
    policy = load_policy(Config.model_validate({"lora": {"r": 4}}))
    torch.manual_seed(0)
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:  # non-zero, so that gradients reach lora_A too
            param.data.normal_(0, 0.05)
    return policy


@pytest.fixture(scope="module")
def base_policy():
    return make_base_policy()


def make_batch(policy, advantages=ADVANTAGES, seed=0, rows=None):
    generator = torch.Generator().manual_seed(seed)
    lengths = LENGTHS if rows is None else [LENGTHS[row % len(LENGTHS)] for row in range(rows)]
    prompts = [[10 + i, 20, 30 + i] for i in range(len(lengths))]
    completions = [torch.randint(40, 300, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        logps, _, mask = completion_logprobs(policy.model, pack(prompts, completions))
    # The engine's logprobs differ from the trainer's, so the importance weights are not all 1
    sampling = (logps + 0.3 * torch.randn(logps.shape, generator=generator)) * mask
    return RolloutBatch(prompts, completions, sampling, mask, torch.tensor(advantages, dtype=torch.float32),
                        samples=[(f"p{i}", f"c{i}", 0.0) for i in range(len(lengths))],
                        versions=list(range(len(lengths))))


def run_update(policy, batches, **overrides):
    """(policy, optimizer, scheduler, metrics of the last step) after one optimize per batch."""
    policy = copy.deepcopy(policy)
    config = Config.model_validate({"lora": {"r": 4}, **overrides})
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 10)
    for batch in batches:
        metrics = optimize(config, policy, batch, optimizer, scheduler)
    return policy, optimizer, scheduler, metrics


def trainable(policy):
    return {n: p for n, p in policy.model.named_parameters() if p.requires_grad}


def assert_same_update(unfiltered, filtered, atol=ATOL, rtol=RTOL, weight_atol=LR / 10):
    """Gradients of the last iteration, adapter weights and AdamW state.

    The weights get their own tolerance: AdamW divides by sqrt(v) + 1e-8, and clipped gradient
    entries of ~1e-9 turn summation-order noise into a few % of lr, while a missed or extra step
    moves a weight by ~lr."""
    policy_a, optimizer_a, scheduler_a, metrics_a = unfiltered
    policy_b, optimizer_b, scheduler_b, metrics_b = filtered
    params_a, params_b = trainable(policy_a), trainable(policy_b)
    assert params_a.keys() == params_b.keys() and params_a
    for name in params_a:
        torch.testing.assert_close(params_b[name].grad, params_a[name].grad, atol=atol, rtol=rtol, msg=name)
        torch.testing.assert_close(params_b[name].detach(), params_a[name].detach(), atol=weight_atol, rtol=0,
                                   msg=name)
    state_a, state_b = optimizer_a.state_dict()["state"], optimizer_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for key in state_a[index]:
            torch.testing.assert_close(state_b[index][key], state_a[index][key], atol=atol, rtol=rtol)
    assert scheduler_b.state_dict() == scheduler_a.state_dict()
    assert metrics_b["loss"] == pytest.approx(metrics_a["loss"], abs=atol)
    assert metrics_b["grad_norm"] == pytest.approx(metrics_a["grad_norm"], abs=atol, rel=rtol)


@pytest.mark.parametrize("micro_batch_size", [2, 3])
@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("level", ["token", "sequence_product"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_filtered_update_equals_the_unfiltered_one(base_policy, loss_type, level, num_iterations, micro_batch_size):
    batch = make_batch(base_policy)
    filtered, _ = filter_zero_advantage(batch, micro_batch_size, every_row=False)
    assert len(filtered) == len(KEPT_ROWS)
    # max_grad_norm low enough that clipping acts
    overrides = dict(train={"micro_batch_size": micro_batch_size, "lr": LR, "max_grad_norm": 0.05},
                     algo={"loss_type": loss_type, "num_iterations": num_iterations,
                           "importance_sampling": {"level": level}})
    unfiltered_run = run_update(base_policy, [batch], **overrides)
    filtered_run = run_update(base_policy, [filtered], **overrides)
    assert unfiltered_run[3]["grad_norm"] > 0
    assert_same_update(unfiltered_run, filtered_run)


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_filtered_rollout_batches_merge_into_the_unfiltered_step(base_policy, loss_type):
    # Batches of 8 rows in micro-batches of 4: filtering each then merging keeps bnpo's partition.
    first, second = make_batch(base_policy, seed=1), make_batch(base_policy, ADVANTAGES[::-1], seed=2)
    merged = merge([filter_zero_advantage(b, 4, every_row=False)[0] for b in (first, second)])
    assert merged.counts == StepCounts(16, 2 * sum(LENGTHS), [14, 12, 14, 12], [2, 1, 1, 2], [4, 4, 4, 4])
    overrides = dict(train={"micro_batch_size": 4, "lr": LR}, algo={"loss_type": loss_type})
    assert_same_update(run_update(base_policy, [merge([first, second])], **overrides),
                       run_update(base_policy, [merged], **overrides))


def count_forward_passes(monkeypatch) -> list[int]:
    calls = []
    original = driver.update.step.completion_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(driver.update.step, "completion_logprobs", counting)
    return calls


def test_filtering_saves_forward_passes(base_policy, monkeypatch):
    calls = count_forward_passes(monkeypatch)
    filtered, _ = filter_zero_advantage(make_batch(base_policy), 3, every_row=False)
    run_update(base_policy, [filtered], train={"micro_batch_size": 3}, algo={"num_iterations": 2})
    assert len(calls) == 1 + 2  # old logprobs, then one micro-batch per iteration (3 rows re-packed)


@pytest.mark.parametrize("zero_advantage", ["skip", "keep"])
def test_all_zero_batch_makes_no_forward_pass_and_steps_the_optimizer_the_same(base_policy, monkeypatch,
                                                                               zero_advantage):
    # A first step with signal gives AdamW moments, so the zero-gradient step still moves the weights.
    signal, zero = make_batch(base_policy, seed=3), make_batch(base_policy, [0.0] * 8, seed=4)
    filtered, metrics = filter_zero_advantage(zero, 3, every_row=False)
    assert len(filtered) == 0 and filtered.mask.shape == (0, 0)
    assert filtered.counts == StepCounts(8, 26, [10, 11, 5], [0, 0, 0], [3, 3, 2])
    assert metrics["filter/kept_fraction"] == 0.0 and metrics["filter/filtered_sequences"] == 8
    overrides = dict(train={"micro_batch_size": 3},
                     algo={"num_iterations": 2, "zero_advantage": zero_advantage})
    unfiltered_run = run_update(base_policy, [signal, zero], **overrides)
    calls = count_forward_passes(monkeypatch)
    after_signal, *_ = run_update(base_policy, [signal], **overrides)
    signal_calls = len(calls)
    filtered_run = run_update(base_policy, [signal, filtered], **overrides)
    assert len(calls) == 2 * signal_calls and filtered_run[3]["grad_norm"] == 0.0
    assert_same_update(unfiltered_run, filtered_run, atol=0, rtol=0, weight_atol=0)
    moved = [n for n, p in trainable(filtered_run[0]).items() if not torch.equal(p, trainable(after_signal)[n])]
    assert moved  # the zero-gradient steps did step


def test_beta_filters_nothing_and_a_filtered_batch_is_refused_with_beta(base_policy):
    batch = make_batch(base_policy)
    kept, metrics = filter_zero_advantage(batch, 3, every_row=True)
    assert len(kept) == 8 and torch.equal(kept.advantages, batch.advantages)
    assert kept.counts == step_counts(batch, 3) and metrics["filter/kept_fraction"] == 1.0
    run_update(base_policy, [kept], train={"micro_batch_size": 3}, algo={"beta": 0.04})  # trains every row
    filtered, _ = filter_zero_advantage(batch, 3, every_row=False)
    with pytest.raises(ValueError, match="KL or entropy"):
        run_update(base_policy, [filtered], algo={"beta": 0.04})


def test_filter_keeps_rows_in_order_and_narrows_to_the_longest_kept_row(base_policy):
    batch = make_batch(base_policy)
    filtered, metrics = filter_zero_advantage(batch, 3, every_row=False)
    assert filtered.completion_ids == [batch.completion_ids[row] for row in KEPT_ROWS]
    assert filtered.prompt_ids == [batch.prompt_ids[row] for row in KEPT_ROWS]
    assert filtered.versions == KEPT_ROWS and filtered.samples == [batch.samples[row] for row in KEPT_ROWS]
    width = max(LENGTHS[row] for row in KEPT_ROWS)
    assert filtered.mask.shape == (3, width) and width < batch.mask.shape[1]
    torch.testing.assert_close(filtered.sampling_logprobs, batch.sampling_logprobs[KEPT_ROWS, :width], atol=0, rtol=0)
    torch.testing.assert_close(filtered.advantages, batch.advantages[KEPT_ROWS], atol=0, rtol=0)
    # Original micro-batches rows 0-2, 3-5, 6-7: tokens 10, 11, 5; one kept row in each.
    assert filtered.counts == StepCounts(8, sum(LENGTHS), [10, 11, 5], [1, 1, 1], [3, 3, 2])
    assert metrics == {"filter/kept_sequences": 3.0, "filter/filtered_sequences": 5.0, "filter/kept_fraction": 3 / 8,
                       "filter/kept_token_fraction": 9 / 26}
    again, _ = filter_zero_advantage(filtered, 5, every_row=False)  # counts already set: kept, micro_batch_size unused
    assert again.counts == filtered.counts


def test_extend_batch_adds_the_extra_rows_to_the_counts(base_policy):
    filtered, _ = filter_zero_advantage(make_batch(base_policy), 3, every_row=False)
    extra = make_batch(base_policy, [0.5, -0.5, 0.2, -0.2], seed=5, rows=4)
    extended = extend_batch(filtered, extra, 3)
    assert len(extended) == 7 and extended.versions == KEPT_ROWS + [0, 1, 2, 3]
    assert extended.counts == StepCounts(12, sum(LENGTHS) + 14, [10, 11, 5, 10, 4], [1, 1, 1, 3, 1],
                                        [3, 3, 2, 3, 1])
    assert extended.mask.shape[1] == max(filtered.mask.shape[1], extra.mask.shape[1])
    plain = extend_batch(make_batch(base_policy), extra, 8)  # an unfiltered batch gets its counts first
    assert plain.counts == StepCounts(12, sum(LENGTHS) + 14, [26, 14], [8, 4], [8, 4])


def test_merge_carries_metrics_versions_and_refuses_a_mix_of_filtered_and_not(base_policy):
    batch = make_batch(base_policy)
    batch.metrics = {"frac_reward_zero_std": 0.5}
    merged = merge([batch, make_batch(base_policy, seed=1)])
    assert merged.counts is None and merged.metrics == batch.metrics and merged.versions == 2 * list(range(8))
    filtered, _ = filter_zero_advantage(batch, 3, every_row=False)
    with pytest.raises(ValueError, match="StepCounts"):
        merge([filtered, batch])
    with pytest.raises(ValueError, match="at least one"):
        merge([])


def test_bad_arguments_name_the_argument(base_policy):
    batch = make_batch(base_policy)
    for call in (lambda: step_counts(batch, 0), lambda: filter_zero_advantage(batch, 0, every_row=False),
                 lambda: extend_batch(batch, batch, -1)):
        with pytest.raises(ValueError, match="micro_batch_size"):
            call()
    with pytest.raises(ValueError, match="versions"):
        filter_zero_advantage(replace(batch, versions=[0]), 3, every_row=False)
    wrong_counts = replace(batch, counts=StepCounts(8, 26, [26], [7], [8]))
    with pytest.raises(ValueError, match="micro_batch_rows"):
        filter_zero_advantage(wrong_counts, 3, every_row=False)
    with pytest.raises(ValueError, match="micro_batch_rows"):
        run_update(base_policy, [wrong_counts])


TRUNCATED_ROWS = [1, 3]  # mask_truncated_completions zeroed their masks


def truncated_batch(policy):
    batch = make_batch(policy)
    mask = batch.mask.clone()
    mask[TRUNCATED_ROWS] = 0.0
    return replace(batch, mask=mask)


@pytest.mark.parametrize("algo", [{"beta": 0.04}, {"entropy_coef": 0.01}, {"beta": 0.04, "loss_type": "grpo"}])
def test_masked_truncated_rows_are_filtered_even_when_the_loss_acts_on_every_row(base_policy, algo):
    """KL and entropy terms act on every row with tokens, but a masked (truncated) row has none: filtering
    drops it (and only it) and the update is unchanged."""
    batch = truncated_batch(base_policy)
    filtered, metrics = filter_zero_advantage(batch, 3, every_row=True)
    assert metrics["filter/kept_sequences"] == len(LENGTHS) - len(TRUNCATED_ROWS)
    assert filtered.counts.num_tokens == int(batch.mask.sum())  # TRL's num_items_in_batch: truncated left out
    unfiltered = run_update(base_policy, [batch], train={"micro_batch_size": 3}, algo=algo)
    assert_same_update(unfiltered, run_update(base_policy, [filtered], train={"micro_batch_size": 3}, algo=algo))


def test_batch_from_groups_masks_the_completions_cut_at_max_tokens():
    from driver.data.prompts import Prompt
    from driver.data.records import Group, Sample, Span
    from driver.rollouts.batch import batch_from_groups

    samples = [Sample([5, 6, 7], [-0.1, -0.2, -0.3], reason, [Span(0, 3, 0)]) for reason in ("stop", "length")]
    group = Group(0, Prompt(0, "p", [1, 2]), samples, advantages=torch.tensor([0.5, -0.5]), total=torch.zeros(2))
    assert batch_from_groups([group]).mask.sum() == 6
    masked = batch_from_groups([group], mask_truncated=True)
    assert masked.mask[0].sum() == 3 and masked.mask[1].sum() == 0
    assert torch.equal(masked.advantages, group.advantages)  # its reward still shaped the group's advantages


def test_a_replay_buffer_that_cannot_replay_is_warned_about():
    import warnings

    from driver.config import AlgoConfig

    with pytest.warns(UserWarning, match="replays nothing: a KL or entropy term"):
        AlgoConfig(replay_buffer_size=8, beta=0.04)
    with pytest.warns(UserWarning, match="zero_advantage = keep filters nothing"):
        AlgoConfig(replay_buffer_size=8, zero_advantage="keep")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AlgoConfig(replay_buffer_size=8)  # filter, no KL: replay refills the filtered places
        AlgoConfig(replay_buffer_size=8, beta=0.04, dynamic_sampling=True)  # refills short dynamic steps
