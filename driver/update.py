"""The policy update of one step: score the rollout batch on packed sequences and take
num_iterations optimizer updates of the clipped, importance-corrected GRPO loss."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from driver.batch import RolloutBatch
from driver.config import Config
from driver.losses import StepNormalizers, all_zero, connected_zero, importance_weights, off_policy_sequence_mask, policy_loss
from driver.model import Policy
from driver.scoring import completion_logprobs, pack


def merge(batches: list[RolloutBatch]) -> RolloutBatch:
    if len(batches) == 1:
        return batches[0]
    width = max(b.mask.shape[1] for b in batches)

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    return RolloutBatch(
        prompt_ids=[p for b in batches for p in b.prompt_ids],
        completion_ids=[c for b in batches for c in b.completion_ids],
        sampling_logprobs=torch.cat([padded(b.sampling_logprobs) for b in batches]),
        mask=torch.cat([padded(b.mask) for b in batches]),
        advantages=torch.cat([b.advantages for b in batches]),
        samples=[s for b in batches for s in b.samples])


def micro_batches(size: int, total: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


@torch.no_grad()
def frozen_logprobs(policy: Policy, batch: RolloutBatch, parts: list[slice], temperature: float,
                    reference: bool) -> torch.Tensor:
    """Logprobs of the current policy (or of the base, adapter disabled) with dropout off, [N, T]."""
    was_training = policy.model.training
    policy.model.eval()
    out = torch.zeros_like(batch.mask)
    try:
        for part in parts:
            packed = pack(batch.prompt_ids[part], batch.completion_ids[part], device=policy.device)
            if reference:
                with policy.reference():
                    logps, _, _ = completion_logprobs(policy.model, packed, temperature)
            else:
                logps, _, _ = completion_logprobs(policy.model, packed, temperature)
            out[part, : logps.shape[1]] = logps
    finally:
        policy.model.train(was_training)
    return out


def optimize(config: Config, policy: Policy, batch: RolloutBatch, optimizer, scheduler) -> dict[str, float]:
    algo, temperature = config.algo, config.rollout.sampling.temperature
    batch = batch.to(policy.device)
    parts = micro_batches(config.train.micro_batch_size, len(batch))
    normalizers = StepNormalizers(num_sequences=len(batch), num_tokens=int(batch.mask.sum()),
                                  num_micro_batches=len(parts),
                                  max_completion_length=config.rollout.sampling.max_tokens)
    # The reference is the base with the adapter disabled; the old policy is needed as a separate
    # pass only when one batch feeds several updates (with one update it equals the current one).
    ref_logps = frozen_logprobs(policy, batch, parts, temperature, reference=True) if algo.beta > 0 else None
    old_logps = frozen_logprobs(policy, batch, parts, temperature, reference=False) if algo.num_iterations > 1 else None
    params = policy.trainable_parameters()
    totals: dict[str, list[float]] = defaultdict(list)
    policy.model.train()
    for _ in range(algo.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        skipped, step_loss = 0, 0.0
        for part in parts:
            if algo.skip_zero_advantage and algo.beta == 0 and all_zero(batch.advantages[part]):
                connected_zero(params).backward()  # keeps every rank's backward (and allreduce) in step
                skipped += 1
                continue
            metrics = micro_batch_loss(config, policy, batch, part, normalizers, old_logps, ref_logps)
            step_loss += metrics.pop("loss")  # micro-batch losses are normalized to sum to the step's
            for key, value in metrics.items():
                totals[key].append(value)
        totals["loss"].append(step_loss)
        totals["skipped_micro_batch_fraction"].append(skipped / len(parts))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm or math.inf)
        totals["grad_norm"].append(float(grad_norm))
        optimizer.step()
        scheduler.step()
    metrics = {key: sum(values) / len(values) for key, values in totals.items()}
    metrics["learning_rate"] = scheduler.get_last_lr()[0]
    return metrics


def micro_batch_loss(config: Config, policy: Policy, batch: RolloutBatch, part: slice, normalizers: StepNormalizers,
                     old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None) -> dict[str, float]:
    algo = config.algo
    packed = pack(batch.prompt_ids[part], batch.completion_ids[part], device=policy.device)
    logps, entropy, mask = completion_logprobs(policy.model, packed, config.rollout.sampling.temperature,
                                               return_entropy=True, entropy_grad=False)  # entropy: a metric
    width = logps.shape[1]
    old = old_logps[part, :width] if old_logps is not None else logps.detach()
    sampling = batch.sampling_logprobs[part, :width]
    advantages = batch.advantages[part]
    sampling_correction = algo.importance_sampling
    weights, metrics = importance_weights(old, sampling, mask, level=sampling_correction.level,
                                          mode=sampling_correction.mode, cap=sampling_correction.cap)
    keep, mask_metrics = off_policy_sequence_mask(advantages, sampling, old, mask, algo.off_policy_mask_threshold)
    loss, loss_metrics = policy_loss(
        logps, old, advantages, mask * keep[:, None].to(mask.dtype), loss_type=algo.loss_type,
        epsilon_low=algo.epsilon, epsilon_high=algo.epsilon_high if algo.epsilon_high is not None else algo.epsilon,
        beta=algo.beta, normalizers=normalizers,
        ref_logps=ref_logps[part, :width] if ref_logps is not None else None,
        is_weights=weights if sampling_correction.level != "none" else None)
    loss.backward()
    metrics.update(mask_metrics)
    metrics.update(loss_metrics)
    metrics["loss"] = float(loss.detach())
    metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
    return metrics
