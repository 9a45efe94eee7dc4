"""The update step on a real (tiny) policy, without vLLM: micro-batch invariance, zero-advantage
skipping, the KL reference and num_iterations."""

import copy
import math

import pytest
import torch

from driver.config import Config
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import load_policy
from driver.rollouts.batch import RolloutBatch
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import optimize


@pytest.fixture(scope="module")
def base_policy():
    config = Config.model_validate({"lora": {"r": 4}})
    return load_policy(config)


def make_batch(policy, advantages, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2, 4, 1, 6, 3, 2]
    prompts = [[10 + i, 20, 30 + i] for i in range(8)]
    completions = [torch.randint(40, 300, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        logps, _, mask = completion_logprobs(policy.model, pack(prompts, completions))
    return RolloutBatch(prompts, completions, logps.clone(), mask, torch.tensor(advantages, dtype=torch.float32))


def run_update(policy, batch, **overrides):
    policy = copy.deepcopy(policy)
    config = Config.model_validate({"lora": {"r": 4}, **overrides})
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 10)
    metrics = optimize(config, policy, batch, optimizer, scheduler)
    return policy, metrics


def adapter_grads(policy):
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad and p.grad is not None}


ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.0, 0.7, -0.3, 0.9]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradients_do_not_depend_on_the_micro_batch_split(base_policy, loss_type):
    # A non-zero lora_B so that gradients reach lora_A too.
    torch.manual_seed(0)
    for name, param in base_policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(base_policy, ADVANTAGES)
    whole, whole_metrics = run_update(base_policy, batch, train={"micro_batch_size": 8, "lr": 1e-9},
                                      algo={"loss_type": loss_type})
    split, split_metrics = run_update(base_policy, batch, train={"micro_batch_size": 3, "lr": 1e-9},
                                      algo={"loss_type": loss_type})
    grads_whole, grads_split = adapter_grads(whole), adapter_grads(split)
    assert grads_whole.keys() == grads_split.keys() and grads_whole
    for name in grads_whole:
        torch.testing.assert_close(grads_split[name], grads_whole[name], atol=1e-6, rtol=1e-4)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)


def test_all_zero_advantages_skip_every_micro_batch_and_leave_the_adapter(base_policy):
    batch = make_batch(base_policy, [0.0] * 8)
    before = {n: p.detach().clone() for n, p in base_policy.model.named_parameters() if p.requires_grad}
    updated, metrics = run_update(base_policy, batch, train={"micro_batch_size": 3})
    assert metrics["skipped_micro_batch_fraction"] == 1.0 and metrics["grad_norm"] == 0.0
    for name, param in updated.model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and not param.grad.any(), name  # connected, zero
            torch.testing.assert_close(param.detach(), before[name])


def test_kl_term_keeps_zero_advantage_batches(base_policy):
    torch.manual_seed(1)
    for name, param in base_policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(base_policy, [0.0] * 8)
    _, metrics = run_update(base_policy, batch, algo={"beta": 0.1})
    assert metrics["skipped_micro_batch_fraction"] == 0.0
    assert metrics["kl"] > 0 and metrics["grad_norm"] > 0


def test_num_iterations_takes_several_updates_against_fixed_old_logprobs(base_policy):
    batch = make_batch(base_policy, ADVANTAGES)
    once, _ = run_update(base_policy, batch, algo={"num_iterations": 1})
    twice, metrics = run_update(base_policy, batch, algo={"num_iterations": 2})
    changed = [n for (n, a), (_, b) in zip(once.model.named_parameters(), twice.model.named_parameters())
               if a.requires_grad and not torch.equal(a, b)]
    assert changed and metrics["learning_rate"] > 0


def test_moe_qlora_policy_trains_expert_lora_on_nf4_experts():
    from pykernels.nn import NF4ExpertWeight, NF4Linear

    overrides = {"model": {"path": "tiny://qwen3-moe", "qlora": True},
                 "lora": {"r": 4, "targets": ["q_proj", "v_proj"],
                          "expert_targets": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}
    policy = load_policy(Config.model_validate(overrides))
    modules = list(policy.model.modules())
    assert sum(isinstance(m, NF4ExpertWeight) for m in modules) == 4 and any(isinstance(m, NF4Linear) for m in modules)
    assert "grouped MoE kernels on 2 experts modules" in policy.kernels
    torch.manual_seed(0)
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(policy, ADVANTAGES)
    updated, metrics = run_update(policy, batch, **overrides, train={"micro_batch_size": 3}, algo={"beta": 0.04})
    grads = adapter_grads(updated)
    expert_grads = [g for n, g in grads.items() if "experts" in n]
    assert len(expert_grads) == 8 and all(g.abs().sum() > 0 for g in expert_grads)  # A and B, 2 params, 2 layers
    assert metrics["grad_norm"] > 0


# ---------------------------------------------------------------- TRL parity: off-policy mask, metrics

def with_adapter_noise(policy, seed):
    """A copy whose lora_B is non-zero: the adapter moves the policy away from the reference (beta > 0)."""
    policy = copy.deepcopy(policy)
    torch.manual_seed(seed)
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    return policy


def direct_logprobs(policy, batch, temperature=1.0, reference=False):
    """Per sequence, log_softmax(logits / T) of transformers' own forward (no packing, no fused op): [N, T] with
    grad (or without, reference=True, adapter disabled), and the token entropies [N, T], 0 on padding."""
    width = batch.mask.shape[1]
    logps, entropies = [], []
    for prompt, completion in zip(batch.prompt_ids, batch.completion_ids):
        input_ids = torch.tensor([prompt + completion])
        if reference:
            with torch.no_grad(), policy.reference():
                logits = policy.model(input_ids=input_ids).logits[0]
        else:
            logits = policy.model(input_ids=input_ids).logits[0]
        log_probs = (logits[len(prompt) - 1:-1] / temperature).log_softmax(-1)
        token_logps = log_probs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
        logps.append(torch.nn.functional.pad(token_logps, (0, width - len(completion))))
        entropies.append(torch.nn.functional.pad(entropy, (0, width - len(completion))))
    return torch.stack(logps), torch.stack(entropies)


def trl_loss(logps, old, sampling, ref, advantages, mask, *, loss_type, epsilon, beta, cap, threshold):
    """TRL's _compute_loss written as loops: off-policy mask from the sampling logprobs against the CURRENT
    ones (get_off_policy_mask), applied to the clipped term before the importance weight and the KL term;
    the completion mask and the normalizers untouched. One micro-batch holding the whole step."""
    rows = range(len(advantages))
    lengths = [int(mask[i].sum()) for i in rows]
    total, sequence_means, num_tokens = 0.0, 0.0, sum(lengths)
    for i in rows:
        mean_gap = sum(float(sampling[i, t] - logps[i, t].detach()) for t in range(lengths[i])) / max(lengths[i], 1)
        keep = float(advantages[i] >= 0 or mean_gap <= threshold)
        sequence_sum = 0.0
        for t in range(lengths[i]):
            ratio = torch.exp(logps[i, t] - old[i, t])
            clipped = ratio.clamp(1 - epsilon, 1 + epsilon)
            token_loss = -torch.minimum(ratio * advantages[i], clipped * advantages[i]) * keep
            token_loss = token_loss * min(math.exp(float(old[i, t] - sampling[i, t])), cap)
            ref_minus_policy = ref[i, t] - logps[i, t]
            token_loss = token_loss + beta * (torch.exp(ref_minus_policy) - ref_minus_policy - 1)
            sequence_sum = sequence_sum + token_loss
        total = total + sequence_sum
        sequence_means = sequence_means + sequence_sum / max(lengths[i], 1)
    return {"grpo": sequence_means / len(advantages), "bnpo": total / num_tokens, "dapo": total / num_tokens}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_off_policy_mask_matches_trl(base_policy, loss_type):
    """Rows 1 and 3 are dropped or kept differently depending on the policy the drift is measured
    against: the sampling logprobs against the current policy (TRL) drop row 1 and keep row 3; against
    the old policy the reverse. A dropped row keeps its KL term and its tokens in every normalizer."""
    from driver.update.step import micro_batch_loss, micro_batch_plan

    policy = with_adapter_noise(base_policy, seed=3)
    batch = make_batch(policy, ADVANTAGES, seed=4)
    current = batch.sampling_logprobs.clone()  # the current policy's logprobs (make_batch scores them)
    sampling_gap = torch.tensor([0.1, 0.8, 0.2, 0.3, 0.0, 0.9, 1.0, 0.2])[:, None]  # sampling - current
    old_gap = torch.tensor([0.0, 0.6, 0.1, -0.4, 0.0, 0.3, 0.0, 0.1])[:, None]  # old - current
    batch.sampling_logprobs = (current + sampling_gap) * batch.mask
    old_logps = (current + old_gap) * batch.mask
    threshold, beta, cap = 0.5, 0.1, 2.0
    config = Config.model_validate({"lora": {"r": 4}, "train": {"micro_batch_size": 8}, "algo": {
        "loss_type": loss_type, "beta": beta, "off_policy_mask_threshold": threshold,
        "importance_sampling": {"level": "token", "mode": "truncate", "cap": cap}}})
    ref_logps, _ = direct_logprobs(policy, batch, reference=True)
    [(part, normalizers)] = micro_batch_plan(batch, 8, loss_type, config.rollout.sampling.max_tokens)

    ours = copy.deepcopy(policy)
    micro_batch_loss(config, ours, batch, part, normalizers, old_logps, ref_logps)
    oracle = copy.deepcopy(policy)
    logps, _ = direct_logprobs(oracle, batch)
    trl_loss(logps, old_logps, batch.sampling_logprobs, ref_logps, batch.advantages, batch.mask, loss_type=loss_type,
             epsilon=config.algo.epsilon, beta=beta, cap=cap, threshold=threshold).backward()
    grads_ours, grads_oracle = adapter_grads(ours), adapter_grads(oracle)
    assert grads_ours.keys() == grads_oracle.keys() and grads_ours
    for name in grads_ours:
        torch.testing.assert_close(grads_ours[name], grads_oracle[name], atol=1e-6, rtol=1e-4)


def test_metrics_are_token_weighted_and_extremes_over_the_step(base_policy):
    """Micro-batches of 3 rows holding 10, 11 and 5 tokens: every token mean must be the step's token mean,
    every */min and */max the step's extreme, against transformers' own forward over the whole batch."""
    policy = with_adapter_noise(base_policy, seed=5)
    batch = make_batch(policy, ADVANTAGES, seed=6)
    noise = 0.3 * torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(7))
    batch.sampling_logprobs = (batch.sampling_logprobs + noise) * batch.mask
    beta = 0.1
    _, metrics = run_update(policy, batch, train={"micro_batch_size": 3}, algo={"beta": beta})

    with torch.no_grad():
        logps, entropy = direct_logprobs(policy, batch)
    ref, _ = direct_logprobs(policy, batch, reference=True)
    real = batch.mask > 0
    gap = (logps - batch.sampling_logprobs)[real]
    ref_minus_policy = (ref - logps)[real]
    expected = {
        "entropy": entropy[real].mean(),
        "kl": (ref_minus_policy.exp() - ref_minus_policy - 1).mean(),
        "sampling/importance_sampling_ratio/min": gap.exp().min(),
        "sampling/importance_sampling_ratio/mean": gap.exp().mean(),
        "sampling/importance_sampling_ratio/max": gap.exp().max(),
        "sampling/sampling_logp_difference/mean": gap.abs().mean(),
        "sampling/sampling_logp_difference/max": gap.abs().max(),
    }
    wrong = {key: (metrics[key], float(value)) for key, value in expected.items()
             if metrics[key] != pytest.approx(float(value), abs=1e-5, rel=1e-5)}
    assert not wrong, wrong


def test_clip_metrics_do_not_depend_on_the_micro_batch_split(base_policy):
    """The second iteration's ratios leave a tiny trust region: the clipped fractions (token means) and
    their per-sequence extremes must be those of the whole step, whatever the split."""
    policy = with_adapter_noise(base_policy, seed=8)
    batch = make_batch(policy, ADVANTAGES, seed=9)
    algo = {"num_iterations": 2, "epsilon": 0.001}
    _, whole = run_update(policy, batch, train={"micro_batch_size": 8, "lr": 0.05}, algo=algo)
    _, split = run_update(policy, batch, train={"micro_batch_size": 3, "lr": 0.05}, algo=algo)
    keys = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
            "clip_ratio/high_max", "entropy"]
    assert whole["clip_ratio/region_mean"] > 0.05
    wrong = {key: (split.get(key), whole.get(key)) for key in keys
             if key not in split or split[key] != pytest.approx(whole[key], abs=1e-6)}
    assert not wrong, wrong
