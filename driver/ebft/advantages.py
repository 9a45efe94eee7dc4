"""EBFT advantages from the reward parts of each prompt's group of n samples.

"rloo" is the official code's leave-one-out baseline (sjelassi/ebft_openrlhf `compute_baseline`).
The diversity reward of sample k != j contains phi_k . phi_j, so a plain leave-one-out mean of r
still depends on sample j; the baseline of j is instead the mean reward of the other samples
recomputed on the group *without* j (diversity normalized by n - 2):

    baseline_j = mean_{k != j} r_k^(-j)
               = 2a * (sum a - a_j) / (n - 1) - 2b * (sum d - 2 d_j) / (n - 2)
    A_j = r_j - baseline_j = 2a * n / (n - 1) * (a_j - mean a) - 2b * n / (n - 2) * (d_j - mean d)

(a = alignment, d = diversity, alpha = a's coefficient, beta = b's). For n = 2 the one remaining
sample has no other sample to be diverse from, so the diversity part of the baseline is 0 (the n = 1
convention): A_j = 2a * (a_j - a_other) - 2b * d_j, where d_1 = d_2 shifts the whole group alike.
n = 1 has no baseline at all: the config then falls back to "reinforce" with diversity_coef 0 (axolotl's
fallback; driver/config.py Config._check_ebft), with a warning.
"""

from __future__ import annotations

import torch

from driver.ebft.rewards import RewardParts
from driver.rewards.advantages import standardize_groups

ESTIMATORS = ("rloo", "group_norm", "reinforce")


def ebft_advantages(
    parts: RewardParts,
    alignment_coef: float,
    diversity_coef: float,
    estimator: str,
    eps: float = 1e-4,
) -> torch.Tensor:  # [P, n]
    """"rloo" (above), "group_norm" = (r - mean) / (unbiased std + eps) as GRPO's (driver/rewards/advantages.py:
    eps 1e-4, exactly 0 for a group of equal rewards and when n = 1), "reinforce" = r.

    axolotl's group_norm uses eps = 1e-8: a group of samples with (nearly) equal rewards, apart from
    float noise (~1e-7 from float32 features), then gets that noise divided by its own std, advantages
    of order 1 that carry no signal; with 1e-4 they stay ~1e-3, and equal rewards give exact zeros
    (which zero-advantage filtering drops)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")
    reward = parts.reward
    num_samples = reward.shape[1]
    if estimator == "reinforce":
        return reward.clone()
    if estimator == "group_norm":
        return standardize_groups(reward, eps)
    if num_samples == 1:
        raise ValueError("estimator 'rloo' needs n >= 2 samples per prompt, got n = 1; use 'reinforce'")
    alignment, diversity = parts.alignment, parts.diversity
    alignment_term = (2 * alignment_coef * num_samples / (num_samples - 1)
                      * (alignment - alignment.mean(dim=1, keepdim=True)))
    if num_samples == 2:
        return alignment_term - 2 * diversity_coef * diversity
    return alignment_term - (2 * diversity_coef * num_samples / (num_samples - 2)
                             * (diversity - diversity.mean(dim=1, keepdim=True)))
