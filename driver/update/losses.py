"""The GRPO policy loss of one micro-batch, and the corrections applied around it.

Per completion token (GRPO, https://arxiv.org/abs/2402.03300; the decoupled clip range
epsilon_low != epsilon_high is DAPO's "clip-higher", https://arxiv.org/abs/2503.14476):

    ratio = exp(logp - logp_old)
    loss  = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) * is_weight
            + beta * k3,   k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's estimator of KL(policy || ref))

cispo, sapo and vespo replace the clipped surrogate, GSPO's sequence-level ratio replaces the token ratio,
k1 / k2 may replace k3 and an entropy bonus may be subtracted: driver/update/loss_terms.py, TRL's formulas.

The training loop sums the losses of a step's micro-batches before one optimizer step, so every
normalizer counts the WHOLE step (StepNormalizers) and the sum over micro-batches is the step's loss,
whatever the split. The exception is "bnpo", by its definition in TRL: the mean over micro-batches of
each micro-batch's token mean, equal to the step's token mean only when micro-batches hold equal
token counts ("dapo" is the split-independent token mean).

After zero-advantage filtering (driver/rollouts/filtering.py) the normalizers still count the unfiltered step,
so the loss and its gradient are those of the unfiltered batch: the filtered rows add exactly 0 to
every numerator. For bnpo a micro-batch also adds the tokens its filtered rows held
(micro_batch_filtered_tokens) to its own token count.

Padding may hold anything (0, garbage, -inf from an inference engine, NaN weights): every log-ratio
is zeroed there before exp and every per-token value at the end, so losses, weights and gradients
stay finite; torch.where sends no gradient to the branch it did not pick.

Metrics come as Metrics (driver/metrics/combine.py: values + the token or sequence counts of the
means) so that micro-batches, iterations and ranks combine exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from driver.metrics.combine import Metrics
from driver.policy.kl import kl_estimate
from driver.update.loss_terms import (CLIPPED_LOSS_TYPES, LOSS_TYPES, LossOptions, policy_log_ratio, surrogate,
                                      vespo_weights)

IMPORTANCE_LEVELS = ("token", "sequence_product", "none")
IMPORTANCE_MODES = ("truncate", "mask")


DEFAULT_OPTIONS = LossOptions()  # TRL's defaults: token-level ratio, no delta, k3


@dataclass
class StepNormalizers:
    """Counts over the whole optimizer step: every micro-batch of every accumulated rollout batch."""

    num_sequences: int
    num_tokens: int  # completion tokens (sum of mask) in the step
    num_micro_batches: int
    max_completion_length: int  # the sampling limit (Dr. GRPO's constant), not this step's longest
    # bnpo only, the one per-micro-batch count (the update sets it for each micro-batch): completion
    # tokens of this micro-batch's rows removed by zero-advantage filtering, still in its token mean
    micro_batch_filtered_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sequences", "num_micro_batches", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepNormalizers.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_tokens", "micro_batch_filtered_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepNormalizers.{name} must be >= 0, got {getattr(self, name)}")


def policy_loss(
    logps: torch.Tensor,  # [n, T] current policy, requires grad
    old_logps: torch.Tensor,  # [n, T] detached, the policy before this step's updates
    advantages: torch.Tensor,  # [n]
    mask: torch.Tensor,  # [n, T] 1.0 on completion tokens, 0.0 on padding
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    normalizers: StepNormalizers,
    ref_logps: torch.Tensor | None = None,  # [n, T] base model; required when beta > 0
    is_weights: torch.Tensor | None = None,  # [n, T] detached importance weights (importance_weights())
    keep_sequences: torch.Tensor | None = None,  # [n] bool, off_policy_sequence_mask(); None keeps all
    options: LossOptions = DEFAULT_OPTIONS,
    entropy: torch.Tensor | None = None,  # [n, T] token entropies; with grad when options.entropy_coef > 0
    keep_tokens: torch.Tensor | None = None,  # [n, T] bool, high_entropy_mask(); None keeps all
) -> tuple[torch.Tensor, Metrics]:
    """Returns (this micro-batch's share of the step loss, its metrics: token means and per-sequence
    extremes of the clipped fractions, the KL when ref_logps is given).

    keep_sequences zeroes the policy term of the dropped sequences and nothing else, as TRL's off-policy
    mask does: their KL term stays, their tokens still count in every normalizer and metric. keep_tokens
    (top_entropy_quantile) zeroes the policy term and the entropy bonus of the other tokens, as TRL.
    The entropy bonus subtracts entropy_coef x (the kept tokens' entropy summed / the step's tokens): TRL's
    form for its token-normalized losses, used here for every loss type so that it does not depend on how
    the step is split into micro-batches."""
    _check_policy_loss_arguments(logps, old_logps, advantages, mask, loss_type, epsilon_low, epsilon_high,
                                 beta, normalizers, ref_logps, is_weights, keep_sequences)
    _check_same_shape("logps", logps, entropy=entropy, keep_tokens=keep_tokens)
    if options.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy is required when entropy_coef = {options.entropy_coef} > 0")
    # Sums over thousands of tokens lose too much in half precision; the model's logps may be bf16.
    dtype = torch.promote_types(logps.dtype, torch.float32)
    real = mask > 0
    logps = torch.where(real, logps.to(dtype), 0.0)  # cispo and vespo use logp itself, not only the ratio
    token_log_ratio = torch.where(real, logps - old_logps.to(dtype), 0.0)
    ratio = policy_log_ratio(token_log_ratio, real, options.importance_sampling_level).exp()
    advantages = advantages.to(dtype).unsqueeze(1)
    is_weights = torch.where(real, is_weights.detach().to(dtype), 0.0) if is_weights is not None else None
    vespo_phi = (vespo_weights(token_log_ratio, real, advantages, is_weights, options)
                 if loss_type == "vespo" else None)
    per_token = surrogate(loss_type, ratio, logps, advantages, epsilon_low, epsilon_high, options, vespo_phi)
    if keep_sequences is not None:
        per_token = torch.where(keep_sequences.unsqueeze(1), per_token, 0.0)
    if keep_tokens is not None:
        per_token = torch.where(keep_tokens, per_token, 0.0)
    if is_weights is not None and loss_type != "vespo":  # vespo folded them into phi
        per_token = per_token * is_weights
    kl = None
    if ref_logps is not None:
        kl = kl_estimate(logps, ref_logps.to(dtype), real, options.kl_estimator)
        if options.bias_correction_kl:  # samples come from pi_old: pi / pi_old unbiases the estimate (and its gradient)
            kl = kl * ratio
        if beta > 0:
            per_token = per_token + beta * kl
    per_token = torch.where(real, per_token, 0.0)
    loss = _normalize(per_token, real.to(dtype), loss_type, normalizers)
    if options.entropy_coef > 0:
        bonus_tokens = real if keep_tokens is None else real & keep_tokens
        bonus = torch.where(bonus_tokens, entropy.to(dtype), 0.0).sum() / max(normalizers.num_tokens, 1)
        loss = loss - options.entropy_coef * bonus
    metrics = _policy_metrics(ratio, advantages, real, kl, epsilon_low, epsilon_high, loss_type, vespo_phi)
    return loss, metrics


def _normalize(per_token: torch.Tensor,  # [n, T], 0 on padding
               mask: torch.Tensor, loss_type: str, normalizers: StepNormalizers) -> torch.Tensor:
    if loss_type in ("grpo", "sapo"):  # each sequence's token mean, averaged over the step's sequences
        sequence_means = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return sequence_means.sum() / normalizers.num_sequences
    if loss_type == "bnpo":  # this micro-batch's token mean, averaged over the step's micro-batches
        num_tokens = mask.sum() + normalizers.micro_batch_filtered_tokens
        return per_token.sum() / num_tokens.clamp(min=1) / normalizers.num_micro_batches
    if loss_type == "dr_grpo":  # a constant normalizer: no length bias (Dr. GRPO)
        return per_token.sum() / (normalizers.num_sequences * normalizers.max_completion_length)
    if loss_type == "luspo":  # each sequence's term times its length, averaged over sequences (LUSPO)
        return per_token.sum() / normalizers.num_sequences
    # dapo, cispo, vespo: the step's token mean, every token weighs the same whatever its sequence's length
    return per_token.sum() / max(normalizers.num_tokens, 1)


@torch.no_grad()
def _policy_metrics(ratio, advantages, real, kl, epsilon_low, epsilon_high, loss_type, vespo_phi) -> Metrics:
    # Clipped: the clip took the gradient away, i.e. the ratio left the trust region in the direction
    # the advantage pushes it (TRL's clip_ratio/* metrics: token means, and the smallest low / largest
    # high fraction of one sequence's tokens). cispo and vespo log TRL's metrics of their own.
    per_token: dict[str, torch.Tensor] = {}
    clipped = loss_type in CLIPPED_LOSS_TYPES
    low = (ratio < 1 - epsilon_low) & (advantages < 0) & real
    high = (ratio > 1 + epsilon_high) & (advantages > 0) & real
    if clipped:
        per_token.update({"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                          "clip_ratio/region_mean": low | high})
    elif loss_type == "cispo":
        per_token["cispo_clip_ratio"] = (ratio > epsilon_high) & (advantages > 0)
    elif loss_type == "vespo":
        per_token["vespo/phi_seq_mean"] = vespo_phi.expand_as(ratio)
    if kl is not None:
        per_token["kl"] = kl
    dtype = ratio.dtype
    num_tokens = real.sum()
    means = [torch.where(real, values.to(dtype), 0.0).sum() / num_tokens.clamp(min=1) for values in per_token.values()]
    extremes = []
    if clipped:
        sequence_tokens = real.sum(dim=1)
        non_empty = sequence_tokens > 0
        low_fractions = (low.sum(dim=1).to(dtype) / sequence_tokens.clamp(min=1))[non_empty]
        high_fractions = (high.sum(dim=1).to(dtype) / sequence_tokens.clamp(min=1))[non_empty]
        nothing = torch.tensor(math.nan, dtype=dtype, device=ratio.device)
        extremes = [low_fractions.min() if len(low_fractions) else nothing,
                    high_fractions.max() if len(high_fractions) else nothing]
    values = torch.stack([*means, *(value.to(dtype) for value in extremes), num_tokens.to(dtype)]).tolist()
    count = values.pop()  # one device sync for all metrics
    names = [*per_token, *(["clip_ratio/low_min", "clip_ratio/high_max"] if clipped else [])]
    return Metrics(dict(zip(names, values)), {name: count for name in per_token})


def importance_weights(
    old_logps: torch.Tensor,  # [n, T] trainer's logps of the sampled tokens
    sampling_logps: torch.Tensor,  # [n, T] the inference engine's logps of the same tokens
    mask: torch.Tensor,  # [n, T]
    *,
    level: str,
    mode: str,
    cap: float,
    cap_min: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling for the engine-vs-trainer mismatch (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"). Returns detached weights [n, T], 0 on
    padding, and metrics.

    level "token": each token's ratio exp(old - sampling); "sequence_product": the product of the
    sequence's token ratios on all its tokens (TRL's vllm_importance_sampling_mode sequence_*; not
    TRL's importance_sampling_level="sequence", GSPO's geometric mean of the policy ratio).
    "truncate" caps ratios at cap; "mask" zeroes them above cap, exactly, with no renormalization
    that would give the dropped tokens their weight back. cap_min makes either two-sided (TRL's
    vllm_importance_sampling_clip_min): ratios below it are raised to it, or masked (IcePop: a token the
    engine found far likelier than the trainer does is as untrustworthy as the reverse). The ratio
    metrics are of the ratios before the cap (TRL logs them after it); sampling/masked_fraction says how
    many tokens the mask dropped.
    """
    _check_same_shape("old_logps", old_logps, sampling_logps=sampling_logps, mask=mask)
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_MODES}, got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if cap_min is not None and not 0 <= cap_min < cap:
        raise ValueError(f"cap_min must be in [0, cap = {cap}), got {cap_min}")
    with torch.no_grad():
        dtype = torch.promote_types(old_logps.dtype, torch.float32)
        real = mask > 0
        log_gap = torch.where(real, old_logps.to(dtype) - sampling_logps.to(dtype), 0.0)
        ratio, ratio_samples = _importance_ratio(log_gap, real, level)
        zeroed = torch.zeros_like(real)
        if level == "none":  # no correction at all, whatever mode and cap say
            weights = ratio
        elif mode == "truncate":
            weights = ratio.clamp(min=cap_min, max=cap)
        else:
            outside = (ratio > cap) | (ratio < cap_min) if cap_min is not None else ratio > cap
            zeroed = outside & real
            weights = torch.where(zeroed, 0.0, ratio)
        weights = torch.where(real, weights, 0.0)
        num_tokens = real.sum()
        summary = torch.cat([_min_mean_max(ratio_samples), _min_mean_max(log_gap.abs()[real])[1:],
                             (zeroed.sum().to(dtype) / num_tokens.clamp(min=1)).reshape(1),
                             num_tokens.reshape(1).to(dtype)])
    ratio_min, ratio_mean, ratio_max, gap_mean, gap_max, masked_fraction, num_tokens = summary.tolist()
    return weights, Metrics({
        "sampling/importance_sampling_ratio/min": ratio_min,
        "sampling/importance_sampling_ratio/mean": ratio_mean,
        "sampling/importance_sampling_ratio/max": ratio_max,
        "sampling/sampling_logp_difference/mean": gap_mean,
        "sampling/sampling_logp_difference/max": gap_max,
        "sampling/masked_fraction": masked_fraction,
    }, {"sampling/importance_sampling_ratio/mean": float(ratio_samples.numel()),
        "sampling/sampling_logp_difference/mean": num_tokens, "sampling/masked_fraction": num_tokens})


def _importance_ratio(log_gap: torch.Tensor,  # [n, T] old - sampling, 0 on padding
                      real: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio [n, T], the ratios the metrics summarize: one per token, or one per non-empty sequence)."""
    if level == "token":
        ratio = log_gap.exp()
        return ratio, ratio[real]
    if level == "sequence_product":  # the product of the sequence's token ratios, summed in log space
        sequence_ratio = log_gap.sum(dim=1).exp()
        return sequence_ratio.unsqueeze(1).expand_as(log_gap), sequence_ratio[real.any(dim=1)]
    ratio = torch.ones_like(log_gap)
    return ratio, ratio[real]


def _min_mean_max(values: torch.Tensor) -> torch.Tensor:
    """[3]; NaN for all three when there are no values (a micro-batch of empty completions): nothing was
    measured, and combine_metrics leaves NaN extremes and zero-count means out."""
    if values.numel() == 0:
        return torch.full((3,), math.nan, dtype=values.dtype, device=values.device)
    return torch.stack([values.min(), values.mean(), values.max()])


def off_policy_sequence_mask(
    advantages: torch.Tensor,  # [n]
    sampling_logps: torch.Tensor,  # [n, T] the inference engine's logps (the behaviour policy)
    policy_logps: torch.Tensor,  # [n, T] the CURRENT policy's logps (detached here)
    mask: torch.Tensor,  # [n, T]
    threshold: float | None,
) -> tuple[torch.Tensor, Metrics]:
    """Off-policy sequence masking (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, eq. 9): drop a
    sequence whose advantage is negative and whose mean over tokens of sampling_logp - policy_logp (a k1
    estimate of KL(sampling || current policy)) exceeds threshold: pushing down completions the policy
    has drifted far from destabilises training, while a positive advantage is kept whatever the drift.
    The drift is measured against the policy being trained, which covers both the engine mismatch and
    this step's earlier updates (TRL's get_off_policy_mask: the sampling logprobs against the current
    ones). Returns keep [n] bool (policy_loss's keep_sequences); None keeps every sequence.
    """
    _check_same_shape("sampling_logps", sampling_logps, policy_logps=policy_logps, mask=mask)
    if tuple(advantages.shape) != (sampling_logps.shape[0],):
        raise ValueError(f"advantages must have shape [n] = ({sampling_logps.shape[0]},), got "
                         f"{tuple(advantages.shape)}")
    num_sequences = {"off_policy_mask/dropped_fraction": float(len(advantages))}
    if threshold is None:
        return torch.ones_like(advantages, dtype=torch.bool), Metrics({"off_policy_mask/dropped_fraction": 0.0},
                                                                      num_sequences)
    with torch.no_grad():
        dtype = torch.promote_types(sampling_logps.dtype, torch.float32)
        real = mask > 0
        log_gap = torch.where(real, sampling_logps.to(dtype) - policy_logps.detach().to(dtype), 0.0)
        mean_kl = log_gap.sum(dim=1) / real.sum(dim=1).clamp(min=1)
        keep = (advantages >= 0) | (mean_kl <= threshold)
    dropped = (~keep).float().mean().item() if len(keep) else 0.0
    return keep, Metrics({"off_policy_mask/dropped_fraction": dropped}, num_sequences)


def connected_zero(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """A scalar 0 loss that reaches every trainable parameter.

    Stands in for the loss of a micro-batch skipped because its advantages are all zero: backward
    still gives every trainable parameter a (zero) gradient, so gradient hooks and the collectives of
    data-parallel wrappers run as on any other micro-batch.
    """
    trainable = [parameter for parameter in parameters if parameter.requires_grad]
    if not trainable:
        raise ValueError("parameters holds no parameter that requires grad: nothing to connect the loss to")
    # Summed in float32: a half-precision sum can overflow to inf, and inf * 0 is NaN.
    device = trainable[0].device
    return sum(parameter.sum(dtype=torch.float32).to(device) for parameter in trainable) * 0.0


def all_zero(advantages: torch.Tensor) -> bool:
    """True when no completion carries a learning signal (combine_rewards gives exact zeros to groups of
    equal rewards)."""
    return not bool(advantages.any())


def _check_same_shape(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    if reference.dim() != 2:
        raise ValueError(f"{reference_name} must have shape [n, T], got {tuple(reference.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, "
                             f"got {tuple(tensor.shape)}")


def _check_policy_loss_arguments(logps, old_logps, advantages, mask, loss_type, epsilon_low, epsilon_high,
                                 beta, normalizers, ref_logps, is_weights, keep_sequences) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    _check_same_shape("logps", logps, old_logps=old_logps, mask=mask, ref_logps=ref_logps, is_weights=is_weights)
    num_sequences = logps.shape[0]
    if tuple(advantages.shape) != (num_sequences,):
        raise ValueError(f"advantages must have shape [n] = ({num_sequences},), got {tuple(advantages.shape)}")
    if keep_sequences is not None and (keep_sequences.dtype != torch.bool
                                       or tuple(keep_sequences.shape) != (num_sequences,)):
        raise ValueError(f"keep_sequences must be a bool tensor of shape [n] = ({num_sequences},), got "
                         f"{keep_sequences.dtype} of shape {tuple(keep_sequences.shape)}")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps (the base model's logps) is required when beta = {beta} > 0")
    if num_sequences > normalizers.num_sequences:
        raise ValueError(f"normalizers.num_sequences = {normalizers.num_sequences} is smaller than this "
                         f"micro-batch ({num_sequences} sequences); it must count the whole step")
