"""algo.steps_per_generation: one generated batch trained as several optimizer steps, against TRL's
loop written out here (GRPOTrainer: the generation batch split into steps_per_generation parts, each
an optimizer step normalized alone, every part once per iteration, old_per_token_logps from the policy
before the first step, the vLLM importance ratio exp(old - sampling) truncated at the cap), on
unpacked transformers forwards; and on filtered batches, whose parts must keep the unfiltered counts."""

import copy

import pytest
import torch

from driver.config import Config
from driver.rollouts.filtering import filter_zero_advantage, split_steps, step_counts
from driver.update.optim import build_scheduler
from driver.update.step import optimize
from tests.driver.rollouts.test_driver_filtering import ADVANTAGES, LENGTHS, make_base_policy, make_batch

# Plain SGD on both sides (optimize takes any optimizer): AdamW's first steps are ~ LR x sign(grad), which
# turns float noise in the ~0 gradients into weight differences and hides what this test is about.
LR, CAP, EPSILON = 0.5, 2.0, 0.2  # a large step: the second part's policy is visibly not the first's


@pytest.fixture(scope="module")
def base_policy():
    return make_base_policy()


def config_of(**algo):
    return Config.model_validate({"lora": {"r": 4}, "train": {"micro_batch_size": 2, "lr": LR},
                                  "algo": {"loss_type": "dapo", **algo}})


def ours(policy, batch, config):
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=LR)
    scheduler = build_scheduler(optimizer, config.train, config.optimizer_updates)
    metrics = optimize(config, policy, batch, optimizer, scheduler)
    return policy, metrics


def row_logprobs(model, prompt, completion):
    """log p(completion | prompt), one row unpacked, by the model's own forward."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def trl_loop(policy, batch, config):
    """TRL's steps over one generation batch: parts of rows, loss_type dapo or grpo."""
    policy = copy.deepcopy(policy)
    algo, steps = config.algo, config.algo.steps_per_generation
    params = policy.trainable_parameters()
    optimizer = torch.optim.SGD(params, lr=LR)
    rows = len(batch)
    with torch.no_grad():
        policy.model.eval()
        old = [row_logprobs(policy.model, batch.prompt_ids[r], batch.completion_ids[r]) for r in range(rows)]
        policy.model.train()
    bounds = [round(i * rows / steps) for i in range(steps + 1)]
    for _ in range(algo.num_iterations):
        for first, last in zip(bounds, bounds[1:]):
            optimizer.zero_grad()
            per_row = []
            for r in range(first, last):
                length = len(batch.completion_ids[r])
                logps = row_logprobs(policy.model, batch.prompt_ids[r], batch.completion_ids[r])
                ratio = torch.exp(logps - old[r])
                advantage = batch.advantages[r]
                loss = -torch.min(ratio * advantage, torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON) * advantage)
                is_ratio = torch.clamp(torch.exp(old[r] - batch.sampling_logprobs[r, :length]), max=CAP)
                per_row.append(loss * is_ratio)
            if algo.loss_type == "dapo":
                step_loss = torch.cat(per_row).sum() / sum(len(row) for row in per_row)
            else:  # grpo
                step_loss = torch.stack([row.mean() for row in per_row]).mean()
            step_loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
            optimizer.step()
    return policy


def trainable(policy):
    return {n: p.detach() for n, p in policy.model.named_parameters() if p.requires_grad}


def assert_same_weights(left, right, atol=1e-6):
    left, right = trainable(left), trainable(right)
    assert left.keys() == right.keys() and left
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize(("loss_type", "steps", "iterations"),
                         [("dapo", 2, 1), ("grpo", 2, 1), ("dapo", 4, 2)])
def test_steps_per_generation_is_trls_loop(base_policy, loss_type, steps, iterations):
    batch = make_batch(base_policy)  # 8 rows, micro-batches of 2: 4 micro-batches
    config = config_of(loss_type=loss_type, steps_per_generation=steps, num_iterations=iterations,
                       zero_advantage="keep")
    updated, metrics = ours(base_policy, batch, config)
    assert_same_weights(updated, trl_loop(base_policy, batch, config))
    assert metrics["learning_rate"] == pytest.approx(LR)
    # The oracle can tell: a single step over the whole batch moves the weights elsewhere.
    single, _ = ours(base_policy, batch, config_of(loss_type=loss_type, num_iterations=iterations,
                                                   zero_advantage="keep"))
    with pytest.raises(AssertionError):
        assert_same_weights(single, updated)


def test_every_part_uses_the_old_logprobs_of_the_policy_that_generated(base_policy, monkeypatch):
    import driver.update.step as step

    batch = make_batch(base_policy)
    seen = []  # (rows of the part, old logprobs given, the policy's own logprobs at that moment)
    original = step.micro_batch_loss

    def recording(config, policy, part_batch, part, normalizers, old_logps, ref_logps, term=None, **options):
        with torch.no_grad():
            now = [row_logprobs(policy.model, part_batch.prompt_ids[r], part_batch.completion_ids[r])
                   for r in range(part.start, part.stop)]
        seen.append((part_batch.completion_ids[part], old_logps[part], now))
        return original(config, policy, part_batch, part, normalizers, old_logps, ref_logps, term, **options)

    monkeypatch.setattr(step, "micro_batch_loss", recording)
    ours(base_policy, batch, config_of(steps_per_generation=2, zero_advantage="keep"))
    with torch.no_grad():
        generating = {tuple(c): row_logprobs(base_policy.model, p, c)
                      for p, c in zip(batch.prompt_ids, batch.completion_ids)}
    assert len(seen) == 4  # 2 parts x 2 micro-batches
    for completions, old, _ in seen:
        for index, completion in enumerate(completions):
            torch.testing.assert_close(old[index, : len(completion)], generating[tuple(completion)], atol=1e-5, rtol=0)
    moved = max(float((now[0] - old[0, : len(now[0])]).abs().max()) for _, old, now in seen[2:])
    assert moved > 1e-3  # the second part trains a policy that has moved since generation


def test_parts_are_runs_of_whole_micro_batches(base_policy):
    batch = make_batch(base_policy)
    parts = split_steps(batch, 3, micro_batch_size=2)  # micro-batches of rows 0-1, 2-3, 4-5, 6-7
    assert [len(part) for part in parts] == [2, 4, 2]  # bounds round(0, 4/3, 8/3, 4) = 0, 1, 3, 4
    assert [part.completion_ids for part in parts] == [batch.completion_ids[:2], batch.completion_ids[2:6],
                                                       batch.completion_ids[6:]]
    assert [part.counts.num_sequences for part in parts] == [2, 4, 2]
    assert [part.counts.num_tokens for part in parts] == [sum(LENGTHS[:2]), sum(LENGTHS[2:6]), sum(LENGTHS[6:])]
    assert sum((part.counts for part in parts[1:]), parts[0].counts) == step_counts(batch, 2)


def test_a_short_batch_makes_no_update_for_its_empty_parts(base_policy):
    """Dynamic sampling may leave a step with fewer micro-batches than steps_per_generation: the parts
    without any make no optimizer step (the schedule still advances), the others train as usual."""
    batch = make_batch(base_policy)  # 4 micro-batches of 2 rows
    parts = split_steps(batch, 6, micro_batch_size=2)
    assert [len(part) for part in parts] == [2, 0, 2, 2, 0, 2]  # bounds round(0, 2/3, 4/3, 2, 8/3, 10/3, 4)
    config = config_of(steps_per_generation=4, zero_advantage="keep")
    reference, _ = ours(base_policy, batch, config)
    updated, _ = ours(base_policy, batch, config_of(steps_per_generation=6, zero_advantage="keep"))
    assert_same_weights(updated, reference)  # the same four updates, none from the empty parts

def test_filtered_parts_keep_the_unfiltered_counts(base_policy):
    batch = make_batch(base_policy)  # ADVANTAGES: rows 0, 1, 4, 5, 7 are exact zeros
    filtered, _ = filter_zero_advantage(batch, 2, every_row=False)
    first, second = split_steps(filtered, 2, micro_batch_size=2)
    assert first.completion_ids == [batch.completion_ids[r] for r in (2, 3)]
    assert second.completion_ids == [batch.completion_ids[6]]
    assert (first.counts.num_sequences, first.counts.num_tokens) == (4, sum(LENGTHS[:4]))
    assert (second.counts.num_sequences, second.counts.num_tokens) == (4, sum(LENGTHS[4:]))
    for loss_type in ("dapo", "grpo", "bnpo", "dr_grpo"):
        config = config_of(loss_type=loss_type, steps_per_generation=2)
        unfiltered, _ = ours(base_policy, batch, config)
        assert_same_weights(unfiltered, ours(base_policy, filtered, config)[0], atol=1e-6)
    assert ADVANTAGES[7] == 0.0


def test_a_step_needs_a_micro_batch_and_strided_ebft_refuses():
    with pytest.raises(ValueError, match="steps_per_generation = 5.*4 micro-batch"):
        Config.model_validate({"train": {"prompts_per_step": 2, "micro_batch_size": 4},
                               "algo": {"num_generations": 8, "steps_per_generation": 5}})
    with pytest.raises(ValueError, match="strided"):
        Config.model_validate({"algo": {"name": "ebft", "steps_per_generation": 2}, "ebft": {"mode": "strided"}})
    config = Config.model_validate({"train": {"steps": 10}, "algo": {"steps_per_generation": 2, "num_iterations": 3}})
    assert config.optimizer_updates == 60
