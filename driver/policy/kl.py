"""Per-token estimators of KL(policy || reference) from the sampled tokens' logprobs (Schulman,
"Approximating KL divergence", 2020): the loss's KL term (driver/update/losses.py) and the KL penalty
in the reward (algo.kl_in_reward, driver/rollouts/kl_penalty.py) use the same ones."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, real: torch.Tensor, estimator: str) -> torch.Tensor:
    """k1 = log(p / ref) (unbiased, high variance, can be negative), k2 = log(p / ref)^2 / 2,
    k3 = ref / p - log(ref / p) - 1 (unbiased, >= 0, TRL's). 0 on padding."""
    log_gap = torch.where(real, logps - ref_logps, 0.0)
    if estimator == "k1":
        return log_gap
    if estimator == "k2":
        return 0.5 * log_gap.square()
    if estimator == "k3":
        return (-log_gap).exp() + log_gap - 1
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
