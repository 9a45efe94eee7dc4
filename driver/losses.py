"""The GRPO policy loss of one micro-batch, and the corrections applied around it.

Per completion token (GRPO, https://arxiv.org/abs/2402.03300; the decoupled clip range
epsilon_low != epsilon_high is DAPO's "clip-higher", https://arxiv.org/abs/2503.14476):

    ratio = exp(logp - logp_old)
    loss  = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) * is_weight
            + beta * k3,   k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's estimator of KL(policy || ref))

The training loop sums the losses of a step's micro-batches before one optimizer step, so every
normalizer counts the WHOLE step (StepNormalizers) and the sum over micro-batches is the step's loss,
whatever the split. The exception is "bnpo", by its definition in TRL: the mean over micro-batches of
each micro-batch's token mean, equal to the step's token mean only when micro-batches hold equal
token counts ("dapo" is the split-independent token mean).

After zero-advantage filtering (driver/filtering.py) the normalizers still count the unfiltered step,
so the loss and its gradient are those of the unfiltered batch: the filtered rows add exactly 0 to
every numerator. For bnpo a micro-batch also adds the tokens its filtered rows held
(micro_batch_filtered_tokens) to its own token count.

Padding may hold anything (0, garbage, -inf from an inference engine, NaN weights): every log-ratio
is zeroed there before exp and every per-token value at the end, so losses, weights and gradients
stay finite; torch.where sends no gradient to the branch it did not pick.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_LEVELS = ("token", "sequence", "none")
IMPORTANCE_MODES = ("truncate", "mask")


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (this micro-batch's share of the step loss, metrics averaged over its tokens)."""
    _check_policy_loss_arguments(logps, old_logps, advantages, mask, loss_type, epsilon_low, epsilon_high,
                                 beta, normalizers, ref_logps, is_weights)
    # Sums over thousands of tokens lose too much in half precision; the model's logps may be bf16.
    dtype = torch.promote_types(logps.dtype, torch.float32)
    real = mask > 0
    logps = logps.to(dtype)
    ratio = torch.where(real, logps - old_logps.to(dtype), 0.0).exp()
    advantages = advantages.to(dtype).unsqueeze(1)
    clipped_ratio = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(dtype)
    k3 = None
    if ref_logps is not None:
        ref_minus_policy = torch.where(real, ref_logps.to(dtype) - logps, 0.0)
        k3 = ref_minus_policy.exp() - ref_minus_policy - 1
        if beta > 0:
            per_token = per_token + beta * k3
    per_token = torch.where(real, per_token, 0.0)
    loss = _normalize(per_token, real.to(dtype), loss_type, normalizers)
    return loss, _policy_metrics(ratio, advantages, real, k3, epsilon_low, epsilon_high)


def _normalize(per_token: torch.Tensor,  # [n, T], 0 on padding
               mask: torch.Tensor, loss_type: str, normalizers: StepNormalizers) -> torch.Tensor:
    if loss_type == "grpo":  # each sequence's token mean, averaged over the step's sequences
        sequence_means = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return sequence_means.sum() / normalizers.num_sequences
    if loss_type == "bnpo":  # this micro-batch's token mean, averaged over the step's micro-batches
        num_tokens = mask.sum() + normalizers.micro_batch_filtered_tokens
        return per_token.sum() / num_tokens.clamp(min=1) / normalizers.num_micro_batches
    if loss_type == "dr_grpo":  # a constant normalizer: no length bias (Dr. GRPO)
        return per_token.sum() / (normalizers.num_sequences * normalizers.max_completion_length)
    # dapo: the step's token mean, every token weighs the same whatever its sequence's length
    return per_token.sum() / max(normalizers.num_tokens, 1)


@torch.no_grad()
def _policy_metrics(ratio, advantages, real, k3, epsilon_low, epsilon_high) -> dict[str, float]:
    # Clipped means: the clip took the gradient away, i.e. the ratio left the trust region in the
    # direction the advantage pushes it (TRL's clip_ratio/* metrics).
    low = (ratio < 1 - epsilon_low) & (advantages < 0) & real
    high = (ratio > 1 + epsilon_high) & (advantages > 0) & real
    per_token = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    if k3 is not None:
        per_token["kl"] = k3
    num_tokens = real.sum().clamp(min=1)
    means = torch.stack([torch.where(real, values.to(ratio.dtype), 0.0).sum() / num_tokens
                         for values in per_token.values()])
    return dict(zip(per_token, means.tolist()))  # one device sync for all metrics


def importance_weights(
    old_logps: torch.Tensor,  # [n, T] trainer's logps of the sampled tokens
    sampling_logps: torch.Tensor,  # [n, T] the inference engine's logps of the same tokens
    mask: torch.Tensor,  # [n, T]
    *,
    level: str,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance sampling for the engine-vs-trainer mismatch (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"). Returns detached weights [n, T], 0 on
    padding, and metrics.

    "truncate" caps ratios at cap; "mask" zeroes them above cap, exactly, with no renormalization
    that would give the dropped tokens their weight back.
    """
    _check_same_shape("old_logps", old_logps, sampling_logps=sampling_logps, mask=mask)
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"level must be one of {IMPORTANCE_LEVELS}, got {level!r}")
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"mode must be one of {IMPORTANCE_MODES}, got {mode!r}")
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    with torch.no_grad():
        dtype = torch.promote_types(old_logps.dtype, torch.float32)
        real = mask > 0
        log_gap = torch.where(real, old_logps.to(dtype) - sampling_logps.to(dtype), 0.0)
        ratio, ratio_samples = _importance_ratio(log_gap, real, level)
        zeroed = torch.zeros_like(real)
        if level == "none":  # no correction at all, whatever mode and cap say
            weights = ratio
        elif mode == "truncate":
            weights = ratio.clamp(max=cap)
        else:
            zeroed = (ratio > cap) & real
            weights = torch.where(zeroed, 0.0, ratio)
        weights = torch.where(real, weights, 0.0)
        summary = torch.cat([_min_mean_max(ratio_samples, empty=1.0),
                             _min_mean_max(log_gap.abs()[real], empty=0.0)[1:],
                             (zeroed.sum().to(dtype) / real.sum().clamp(min=1)).reshape(1)])
    ratio_min, ratio_mean, ratio_max, gap_mean, gap_max, masked_fraction = summary.tolist()
    return weights, {
        "sampling/importance_sampling_ratio/min": ratio_min,
        "sampling/importance_sampling_ratio/mean": ratio_mean,
        "sampling/importance_sampling_ratio/max": ratio_max,
        "sampling/sampling_logp_difference/mean": gap_mean,
        "sampling/sampling_logp_difference/max": gap_max,
        "sampling/masked_fraction": masked_fraction,
    }


def _importance_ratio(log_gap: torch.Tensor,  # [n, T] old - sampling, 0 on padding
                      real: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio [n, T], the ratios the metrics summarize: one per token, or one per non-empty sequence)."""
    if level == "token":
        ratio = log_gap.exp()
        return ratio, ratio[real]
    if level == "sequence":  # the product of the sequence's token ratios, summed in log space
        sequence_ratio = log_gap.sum(dim=1).exp()
        return sequence_ratio.unsqueeze(1).expand_as(log_gap), sequence_ratio[real.any(dim=1)]
    ratio = torch.ones_like(log_gap)
    return ratio, ratio[real]


def _min_mean_max(values: torch.Tensor, empty: float) -> torch.Tensor:
    """[3]; `empty` for all three when there are no values (a micro-batch of empty completions)."""
    if values.numel() == 0:
        return torch.full((3,), empty, dtype=values.dtype, device=values.device)
    return torch.stack([values.min(), values.mean(), values.max()])


def off_policy_sequence_mask(
    advantages: torch.Tensor,  # [n]
    sampling_logps: torch.Tensor,  # [n, T] the inference engine's logps
    policy_logps: torch.Tensor,  # [n, T] the trainer's logps
    mask: torch.Tensor,  # [n, T]
    threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Off-policy sequence masking (DeepSeek-V3.2): drop a sequence whose advantage is negative and whose
    mean over tokens of sampling_logp - policy_logp (a k1 estimate of KL(sampling || policy)) exceeds
    threshold: pushing down completions the policy has drifted far from destabilises training, while
    a positive advantage is kept whatever the drift. Returns keep [n] bool; None keeps every sequence.
    """
    _check_same_shape("sampling_logps", sampling_logps, policy_logps=policy_logps, mask=mask)
    if tuple(advantages.shape) != (sampling_logps.shape[0],):
        raise ValueError(f"advantages must have shape [n] = ({sampling_logps.shape[0]},), got "
                         f"{tuple(advantages.shape)}")
    if threshold is None:
        return torch.ones_like(advantages, dtype=torch.bool), {"off_policy_mask/dropped_fraction": 0.0}
    with torch.no_grad():
        dtype = torch.promote_types(sampling_logps.dtype, torch.float32)
        real = mask > 0
        log_gap = torch.where(real, sampling_logps.to(dtype) - policy_logps.to(dtype), 0.0)
        mean_kl = log_gap.sum(dim=1) / real.sum(dim=1).clamp(min=1)
        keep = (advantages >= 0) | (mean_kl <= threshold)
    return keep, {"off_policy_mask/dropped_fraction": (~keep).float().mean().item()}


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
                                 beta, normalizers, ref_logps, is_weights) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    _check_same_shape("logps", logps, old_logps=old_logps, mask=mask, ref_logps=ref_logps, is_weights=is_weights)
    num_sequences = logps.shape[0]
    if tuple(advantages.shape) != (num_sequences,):
        raise ValueError(f"advantages must have shape [n] = ({num_sequences},), got {tuple(advantages.shape)}")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low} and {epsilon_high}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError(f"ref_logps (the base model's logps) is required when beta = {beta} > 0")
    if num_sequences > normalizers.num_sequences:
        raise ValueError(f"normalizers.num_sequences = {normalizers.num_sequences} is smaller than this "
                         f"micro-batch ({num_sequences} sequences); it must count the whole step")
