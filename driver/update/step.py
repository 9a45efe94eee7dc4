"""The policy update of one step: score the rollout batch on packed sequences and take
num_iterations x steps_per_generation optimizer updates of the clipped, importance-corrected GRPO loss.

A zero-advantage filtered batch (driver/rollouts/filtering.py) is trained with the normalizers of the
unfiltered step, which makes its update equal to the unfiltered one when beta = 0. Under torchrun
each rank trains its shard the same way (driver/rollouts/shard_batch.py); every rank runs as many passes as
the busiest one (FSDP's collectives must pair up), and its loss is scaled by the world size because
FSDP averages the gradients of ranks whose losses are already shares of the whole step.

An algorithm may weigh the policy loss and add a cross-entropy term on each prompt's ground truth
(EBFT: rl_coef and ce_coef; driver/update/ground_truth_loss.py), scored in the completions' forward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from driver.config import AlgoConfig, Config
from driver.distributed import world as distributed
from driver.metrics.combine import Metrics, combine_metrics
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import Policy, evaluating
from driver.rollouts.batch import RolloutBatch

# merge is re-exported: callers merge a step's rollout batches with the update's module
from driver.rollouts.filtering import (check_counts, check_every_row_kept, merge, micro_batches,  # noqa: F401
                                      split_steps)
from driver.update.ground_truth_loss import (GroundTruthLoss, check_ground_truths, logprobs_and_document_nll,
                                             micro_batch_documents)
from driver.update.entropy_control import applied_entropy_coef, observe_entropy
from driver.update.optim import optimizer_steps
from driver.update.loss_scale import loss_scale
from driver.update.loss_terms import high_entropy_mask, loss_options
from driver.update.master_weights import gradient_holders
from driver.update.losses import (StepNormalizers, all_zero, connected_zero, importance_weights,
                                  off_policy_sequence_mask, policy_loss)


# micro_batch_loss's entropy over the tokens an entropy bonus acts on (summed, counted), taken out of its metrics
# by the update pass: algo.use_adaptive_entropy measures each update's entropy by them.
BONUS_ENTROPY = ("bonus_entropy_sum", "bonus_tokens")


@torch.no_grad()
def frozen_logprobs(policy: Policy, batch: RolloutBatch, parts: list[slice], temperature: float,
                    reference: bool) -> torch.Tensor:
    """Logprobs of the current policy (or of the base, adapter disabled) with dropout off, [N, T]."""
    out = torch.zeros_like(batch.mask)
    padding = distributed.max_int(len(parts)) - len(parts)  # agreed before any pass: FSDP's collectives pair up
    with evaluating(policy.model):
        for part in parts:
            packed = pack(batch.prompt_ids[part], batch.completion_ids[part], device=policy.device)
            if reference:
                with policy.reference() as model:
                    logps, _, _ = completion_logprobs(model, packed, temperature)
            else:
                logps, _, _ = completion_logprobs(policy.model, packed, temperature)
            out[part, : logps.shape[1]] = logps
        for _ in range(padding):
            padding_pass(policy, temperature, backward=False, reference=reference)
    return out


def optimize(config: Config, policy: Policy, batch: RolloutBatch, optimizer, scheduler,
             term: GroundTruthLoss | None = None) -> dict[str, float]:
    """num_iterations passes over the batch, each algo.steps_per_generation optimizer updates (one per
    part of the batch, split_steps), in TRL's order: every part once, then every part again. term: the
    algorithm's weight of the policy loss and cross-entropy on the ground truth (driver/algorithms.py
    ground_truth_loss), or None: the policy loss alone."""
    algo = config.algo
    _check_filtered_batch(batch, algo.acts_on_every_completion)
    if term is not None and term.trains_ground_truth:
        check_ground_truths(batch)
    batch = batch.to(policy.device)
    parts = (split_steps(batch, algo.steps_per_generation, config.train.micro_batch_size)
             if algo.steps_per_generation > 1 else [batch])
    params = policy.trainable_parameters()
    # Metrics of every micro-batch of every update, and of every update (loss, grad_norm), kept with
    # their token counts: combine_metrics weighs token means by tokens, takes min of */min, ...
    micro_batch_metrics: list[Metrics] = []
    # A part without micro-batches (a step dynamic sampling left short) makes no update; the schedule still steps.
    backward_passes = [update_pass(config, policy, part, params, micro_batch_metrics, term, optimizer)
                       if part.counts is None or part.counts.micro_batch_rows else None for part in parts]
    updates = optimizer_steps(config, params, optimizer, scheduler, backward_passes,
                              after_update=partial(sync_reference, policy, algo) if algo.sync_ref_model else None)
    metrics = combine_metrics(micro_batch_metrics).update(updates)
    values = distributed.reduce_metrics(metrics, summed=loss_names(term))  # each rank's: shares of the step's
    values["learning_rate"] = scheduler.get_last_lr()[0]
    return values


def sync_reference(policy: Policy, algo: AlgoConfig, updates: int) -> None:
    """algo.sync_ref_model: every ref_model_sync_steps optimizer updates, as TRL's SyncRefModelCallback."""
    if updates % algo.ref_model_sync_steps == 0:
        policy.mix_into_reference(algo.ref_model_mixup_alpha)


def update_pass(config: Config, policy: Policy, batch: RolloutBatch, params: list[torch.nn.Parameter],
                micro_batch_metrics: list[Metrics], term: GroundTruthLoss | None = None,
                optimizer: torch.optim.Optimizer | None = None) -> Callable[[], Metrics]:
    """The backward pass of one optimizer update on `batch` (its micro-batches' metrics appended to
    micro_batch_metrics), with the frozen logprobs it needs computed now, before any update. optimizer: where
    algo.use_adaptive_entropy keeps its coefficient (driver/update/entropy_control.py)."""
    algo, temperature = config.algo, config.rollout.sampling.temperature
    parts = micro_batch_plan(batch, config.train.micro_batch_size, algo.loss_type,
                             config.rollout.sampling.max_tokens)
    rows = [part for part, _ in parts]
    # The reference is the base (adapter disabled; full fine-tuning: its frozen copy). The old policy needs
    # a pass of its own only when the batch feeds several updates (with one it equals the current one): it
    # is the policy before the first of them, as TRL's old_per_token_logps.
    ref_logps = frozen_logprobs(policy, batch, rows, temperature, reference=True) if algo.loss_beta > 0 else None
    several = algo.num_iterations > 1 or algo.steps_per_generation > 1
    old_logps = frozen_logprobs(policy, batch, rows, temperature, reference=False) if several else None
    padding = distributed.max_int(len(parts)) - len(parts)
    # A skipped micro-batch runs no FSDP forward, so ranks would fall out of step: only single-process.
    # filter: no zero rows reach here from assembly, and an unfiltered batch is skipped the same way.
    # A cross-entropy term on the ground truth acts on every row, as the KL does.
    skip_zero = (algo.zero_advantage != "keep" and not algo.acts_on_every_completion
                 and not distributed.world().distributed and not (term is not None and term.trains_ground_truth))

    def backward_pass() -> Metrics:
        policy.model.train()
        skipped, step_losses = 0, dict.fromkeys(loss_names(term), 0.0)
        coef = applied_entropy_coef(algo, optimizer) if optimizer is not None else algo.entropy_coef
        scale = loss_scale(config, optimizer)
        bonus_entropy = [0.0, 0.0]  # the entropy summed over the bonus's tokens, and their count
        for part, normalizers in parts:
            # Never after filtering (no zero rows are left); the unfiltered path without KL or entropy keeps it.
            if skip_zero and all_zero(batch.advantages[part]):
                connected_zero(params).backward()  # keeps the graph connected (DDP-style hooks fire)
                skipped += 1
                continue
            metrics = micro_batch_loss(config, policy, batch, part, normalizers, old_logps, ref_logps, term,
                                       entropy_coef=coef, scale=scale)
            for key in step_losses:  # micro-batch losses are normalized to sum to the step's
                step_losses[key] += metrics.values.pop(key)
            for index, key in enumerate(BONUS_ENTROPY):
                bonus_entropy[index] += metrics.values.pop(key)
            micro_batch_metrics.append(metrics)
        for _ in range(padding):
            padding_pass(policy, temperature, backward=True)
        if batch.counts is not None:
            zero_missing_grads(gradient_holders(optimizer, params))
        values = {**step_losses, "skipped_micro_batch_fraction": skipped / len(parts) if parts else 0.0}
        if algo.use_adaptive_entropy and optimizer is not None:  # every rank's tokens: one coefficient for all
            entropy_sum, tokens = distributed.sum_floats(bonus_entropy)
            if tokens:  # an update without loss tokens measures nothing
                values["entropy_coef"] = observe_entropy(algo, optimizer, entropy_sum / tokens)
        return Metrics(values, {"skipped_micro_batch_fraction": float(len(parts))})

    return backward_pass


def loss_names(term: GroundTruthLoss | None) -> tuple[str, ...]:
    """The metrics that are shares of the step's loss, summed over micro-batches and ranks: loss and its parts."""
    return ("loss", *(term.metric_names if term is not None else ()))


def padding_pass(policy: Policy, temperature: float, backward: bool, reference: bool = False) -> None:
    """A one-token forward (and backward of 0 x its loss) that changes nothing but runs the FSDP
    collectives a real pass runs, for a rank with fewer micro-batches than the busiest one. reference: a pass
    of the reference's (under full fine-tuning a sharded model of its own, with collectives of its own)."""
    packed = pack([[0]], [[0]], device=policy.device)
    scored = policy.reference() if reference else contextlib.nullcontext(policy.model)
    with torch.set_grad_enabled(backward), scored as model:
        logps, _, _ = completion_logprobs(model, packed, temperature)
        if backward:
            (logps.sum() * 0.0).backward()


def micro_batch_plan(batch: RolloutBatch, micro_batch_size: int, loss_type: str,
                     max_completion_length: int) -> list[tuple[slice, StepNormalizers]]:
    """The micro-batches of the step, each with the normalizers its loss divides by.

    Unfiltered: rows split every micro_batch_size. Filtered (batch.counts set): the normalizers count
    the unfiltered step; bnpo trains the kept rows of each original micro-batch together (skipping
    those left empty), adding their filtered tokens to the micro-batch's token count; the other loss
    types re-pack the kept rows into full micro-batches (fewer forward passes, the point of filtering).
    """
    counts = batch.counts
    if counts is None:
        parts = micro_batches(micro_batch_size, len(batch))
        normalizers = StepNormalizers(num_sequences=len(batch), num_tokens=int(batch.mask.sum()),
                                      num_micro_batches=len(parts), max_completion_length=max_completion_length)
        return [(part, normalizers) for part in parts]
    normalizers = StepNormalizers(num_sequences=counts.num_sequences, num_tokens=counts.num_tokens,
                                  num_micro_batches=len(counts.micro_batch_tokens),
                                  max_completion_length=max_completion_length)
    if loss_type != "bnpo":
        return [(part, normalizers) for part in micro_batches(micro_batch_size, len(batch))]
    plan, start = [], 0
    for rows, tokens in zip(counts.micro_batch_rows, counts.micro_batch_tokens):
        if rows:
            part = slice(start, start + rows)
            filtered_tokens = tokens - int(batch.mask[part].sum())
            plan.append((part, replace(normalizers, micro_batch_filtered_tokens=filtered_tokens)))
        start += rows
    return plan


def zero_missing_grads(params: list[torch.nn.Parameter]) -> None:
    """Gives a zero gradient to every parameter no kept row reached (all of them for an empty batch):
    the unfiltered update reached every one, and AdamW skips a parameter whose grad is None, while a
    zero gradient still decays its moments, moves it by the momentum and counts its step."""
    for param in params:
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


def _check_filtered_batch(batch: RolloutBatch, every_row: bool) -> None:
    check_counts(batch)
    if not distributed.world().distributed:  # under torchrun rank 0 checks the whole batch before sharding it
        check_every_row_kept(batch, every_row)


def micro_batch_loss(config: Config, policy: Policy, batch: RolloutBatch, part: slice, normalizers: StepNormalizers,
                     old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
                     term: GroundTruthLoss | None = None, entropy_coef: float | None = None,
                     scale: float = 1.0) -> Metrics:
    """Backward of this micro-batch's share of the step loss; its metrics, "loss" (the share) among them, and
    BONUS_ENTROPY (the entropy summed over the tokens an entropy bonus acts on, their count). entropy_coef: the
    bonus's coefficient for this update (algo.use_adaptive_entropy's), else algo.entropy_coef. scale: float16's
    loss scale (driver/update/loss_scale.py), the backward's alone."""
    algo = config.algo
    coef = algo.entropy_coef if entropy_coef is None else entropy_coef
    prompts, completions = batch.prompt_ids[part], batch.completion_ids[part]
    # The entropy is a metric unless the loss has an entropy bonus: only then does it need a gradient.
    temperature, entropy_grad = config.rollout.sampling.temperature, coef > 0
    if term is not None and term.trains_ground_truth:  # the documents' sequences join the completions' forward
        documents = micro_batch_documents(prompts, batch.ground_truth_ids[part])
        logps, entropy, mask, document_nll = logprobs_and_document_nll(
            policy.model, prompts, completions, documents, temperature, entropy_grad, policy.device)
    else:
        packed, documents, document_nll = pack(prompts, completions, device=policy.device), None, None
        logps, entropy, mask = completion_logprobs(policy.model, packed, temperature, return_entropy=True,
                                                   entropy_grad=entropy_grad)
    width = logps.shape[1]
    # The batch's mask may exclude whole rows from the loss (mask_truncated_completions).
    loss_mask = mask * batch.mask[part, :width]
    old = old_logps[part, :width] if old_logps is not None else logps.detach()
    sampling = batch.sampling_logprobs[part, :width]
    advantages = batch.advantages[part]
    sampling_correction = algo.importance_sampling
    weights, metrics = importance_weights(old, sampling, loss_mask, level=sampling_correction.level,
                                          mode=sampling_correction.mode, cap=sampling_correction.cap,
                                          cap_min=sampling_correction.cap_min)
    # Against the current policy, as TRL: the drift since sampling includes this step's earlier updates.
    keep, mask_metrics = off_policy_sequence_mask(advantages, sampling, logps.detach(), loss_mask,
                                                  algo.off_policy_mask_threshold)
    keep_tokens = None
    if algo.top_entropy_quantile < 1:  # the quantile of this rank's micro-batch (docs/trl-differences.md)
        keep_tokens = high_entropy_mask(entropy.detach(), loss_mask > 0, algo.top_entropy_quantile)
    loss, loss_metrics = policy_loss(
        logps, old, advantages, loss_mask, loss_type=algo.loss_type,
        epsilon_low=algo.epsilon, epsilon_high=algo.clip_high, beta=algo.loss_beta, normalizers=normalizers,
        ref_logps=ref_logps[part, :width] if ref_logps is not None else None,
        is_weights=weights if sampling_correction.level != "none" else None,
        keep_sequences=keep if algo.off_policy_mask_threshold is not None else None,
        options=replace(loss_options(algo), entropy_coef=coef), entropy=entropy, keep_tokens=keep_tokens)
    metrics.update(mask_metrics).update(loss_metrics)
    if term is not None:
        loss, term_metrics = term.total(loss, documents, document_nll, normalizers.num_sequences)
        metrics.update(term_metrics)
    (loss * (distributed.world().size * scale)).backward()  # FSDP divides by the world size; the loss is a share
    num_tokens = loss_mask.sum()
    entropy_mean = float((entropy.detach() * loss_mask).sum() / num_tokens.clamp(min=1))
    bonus_tokens = loss_mask > 0 if keep_tokens is None else (loss_mask > 0) & keep_tokens
    bonus = {BONUS_ENTROPY[0]: float(torch.where(bonus_tokens, entropy.detach().float(), 0.0).sum()),
             BONUS_ENTROPY[1]: float(bonus_tokens.sum())}
    return metrics.update(Metrics({"loss": float(loss.detach()), "entropy": entropy_mean, **bonus},
                                  {"entropy": float(num_tokens)}))
