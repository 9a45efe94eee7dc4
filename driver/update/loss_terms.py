"""The per-token terms policy_loss (driver/update/losses.py) sums: the policy surrogate of each loss type
and the high-entropy token mask (the KL estimators: driver/policy/kl.py). Formulas as TRL's
GRPOTrainer._compute_loss defines them (docs/trl-differences.md lists where we differ and why).

Every function takes log ratios that are already 0 on padding and returns values the caller zeroes there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from driver.policy.kl import KL_ESTIMATORS

if TYPE_CHECKING:
    from driver.config import AlgoConfig

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO's clipped surrogate, normalized differently
LOSS_TYPES = (*CLIPPED_LOSS_TYPES, "cispo", "sapo", "vespo")
RATIO_LEVELS = ("token", "sequence")
VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's lower clamp of log w, kept to match its numbers


@dataclass(frozen=True)
class LossOptions:
    """What selects and shapes the per-token surrogate beyond the clip range (TRL's GRPOConfig names)."""

    importance_sampling_level: str = "token"  # "sequence": GSPO's geometric-mean ratio per sequence
    delta: float | None = None  # two-sided clip: the unclipped ratio is capped at delta (INTELLECT-2)
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_estimator: str = "k3"
    bias_correction_kl: bool = False  # the KL term times the policy ratio (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * (step's mean token entropy)

    def __post_init__(self) -> None:
        if self.importance_sampling_level not in RATIO_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {RATIO_LEVELS}, "
                             f"got {self.importance_sampling_level!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.delta is not None and not self.delta > 1:
            raise ValueError(f"delta must be > 1 (it caps the ratio from above), got {self.delta}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")


def loss_options(algo: AlgoConfig) -> LossOptions:
    """The loss's settings from the algo section (its TRL names)."""
    return LossOptions(importance_sampling_level=algo.importance_sampling_level, delta=algo.delta,
                       sapo_temperature_pos=algo.sapo_temperature_pos, sapo_temperature_neg=algo.sapo_temperature_neg,
                       vespo_k_pos=algo.vespo_k_pos, vespo_lambda_pos=algo.vespo_lambda_pos,
                       vespo_k_neg=algo.vespo_k_neg, vespo_lambda_neg=algo.vespo_lambda_neg,
                       kl_estimator=algo.kl_estimator, bias_correction_kl=algo.use_bias_correction_kl,
                       entropy_coef=algo.entropy_coef)


def policy_log_ratio(log_ratio: torch.Tensor,  # [n, T] logp - old, 0 on padding
                     real: torch.Tensor, level: str) -> torch.Tensor:
    """[n, T]: the token log ratios, or (GSPO, arXiv 2507.18071) each sequence's mean log ratio on all of
    its tokens, through which the gradient reaches every token of the sequence."""
    if level == "token":
        return log_ratio
    sequence = log_ratio.sum(dim=1, keepdim=True) / real.sum(dim=1, keepdim=True).clamp(min=1)
    return sequence.expand_as(log_ratio)


def surrogate(loss_type: str, ratio: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor,  # [n, 1]
              epsilon_low: float, epsilon_high: float, options: LossOptions,
              vespo_phi: torch.Tensor | None = None) -> torch.Tensor:
    """The per-token policy loss before importance weights, masks and normalization, [n, T]."""
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
        unclipped = ratio.clamp(max=options.delta) if options.delta is not None else ratio
        return -torch.minimum(unclipped * advantages, clipped * advantages)
    if loss_type == "cispo":  # MiniMax-M1: the clipped ratio is a constant weight on REINFORCE's gradient
        return -ratio.clamp(max=epsilon_high).detach() * advantages * logps
    if loss_type == "sapo":  # a sigmoid gate instead of the hard clip, slope 1 at ratio 1 (arXiv 2511.20347)
        temperature = torch.where(advantages > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
        return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    if loss_type == "vespo":
        if vespo_phi is None:
            raise ValueError("vespo needs its sequence weights (vespo_weights)")
        return -vespo_phi * advantages * logps
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor,  # [n, T] token log ratios logp - old, 0 on padding
                  real: torch.Tensor, advantages: torch.Tensor,  # [n, 1]
                  is_weights: torch.Tensor | None, options: LossOptions) -> torch.Tensor:
    """VESPO's gamma weight phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio w (phi(1) = 1),
    k and lambda by the advantage's sign, [n, 1], detached (arXiv 2602.10693; TRL's get_gamma_weights).
    w folds in the engine-vs-trainer importance weights, which VESPO then does not multiply again."""
    log_w = torch.where(real, log_ratio.clamp(-20.0, 20.0), 0.0).sum(dim=1, keepdim=True)
    if is_weights is not None:
        log_is = torch.log(is_weights).clamp(VESPO_LOG_W_MIN, 20.0)  # a masked (0) weight -> log 1e-8
        log_w = log_w + torch.where(real, log_is, 0.0).sum(dim=1, keepdim=True)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, 20.0)
    non_negative = advantages >= 0
    k = torch.where(non_negative, options.vespo_k_pos, options.vespo_k_neg)
    lam = torch.where(non_negative, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor,  # [n, T]
                      real: torch.Tensor, quantile: float) -> torch.Tensor:
    """The tokens whose entropy is at least the (1 - quantile) quantile of the real tokens' entropies
    ("Beyond the 80/20 rule", arXiv 2506.01939; TRL's top_entropy_quantile, default 1 = every token;
    quantile 0 keeps the highest only). Bool [n, T], False on padding."""
    if not 0 <= quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {quantile}")
    entropy = entropy.to(torch.promote_types(entropy.dtype, torch.float32))  # compared in the dtype it came in
    values = entropy[real]
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = _linear_quantile(values, 1 - quantile)
    return (entropy >= threshold) & real


def _linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's default (linear interpolation) without its 16M-element limit."""
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    low = int(math.floor(position))
    high = min(low + 1, ordered.numel() - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
