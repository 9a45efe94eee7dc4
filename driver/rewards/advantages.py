"""Rewards -> advantages: weight the reward functions, then centre and scale within each prompt's group.

GRPO (DeepSeekMath, https://arxiv.org/abs/2402.03300) replaces PPO's value network by the group of G
completions sampled for the same prompt: advantage = (r - mean_group(r)) / (std_group(r) + eps).
`scale_rewards` picks the divisor as TRL's GRPOTrainer does: the group's std ("group"), the whole
batch's std ("batch"), or none at all ("none", Dr. GRPO https://arxiv.org/abs/2503.20783, which shows
the division up-weights prompts that are too easy or too hard).

`aggregation` says when the reward functions are combined: "sum_then_normalize" weights and sums them
first (TRL's default); "normalize_then_sum" is GDPO (https://arxiv.org/abs/2601.05242, TRL's
multi_objective_aggregation="normalize_then_sum"): each function's rewards become group z-scores, so a
function with a large range cannot drown the others, their weighted sum is then standardized over the
whole batch. GDPO always divides by the group's and the batch's std: scale_rewards does not apply (TRL
ignores it there too).

Layout: N = P prompts x G completions, grouped contiguously (group g is rows g*G .. g*G+G-1).
A reward function returns None (NaN here) for completions it does not apply to; NaN is left out of
every mean and std and counts as 0 in weighted sums. A completion for which EVERY function returned
None has no reward at all: its total reward stays NaN (left out of its group's statistics, as in TRL;
a nansum would make it a reward of 0) and its advantage is 0, so advantages are never NaN.
Every std is unbiased (TRL's nanstd); eps = 1e-4 as in TRL.

algo.advantage_estimator picks verl's RLOO or REINFORCE++ (outcome_advantages) instead of the group
standardization; scale_rewards is then unused. algo.kl_in_reward adds a per-completion KL penalty to the
weighted sum before any of this (verl's token-level rewards summed over the completion); `reward` and
the per-function stats stay the functions' own.
"""

from __future__ import annotations

import math

import torch

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
REWARD_SCALINGS = ("group", "batch", "none")


def combine_rewards(
    rewards_per_func: torch.Tensor,  # [N, F] float; NaN where a reward function returned None
    weights: torch.Tensor,  # [F]
    group_size: int,
    aggregation: str,
    scale_rewards: str,
    eps: float = 1e-4,
    names: list[str] | None = None,  # [F] names for the per-function stats; default "0", "1", ...
    estimator: str = "grpo",
    lengths: torch.Tensor | None = None,  # [N] completion tokens: the reinforce_plus_plus* token weights
    penalty: torch.Tensor | None = None,  # [N] added to the weighted sum before advantages (algo.kl_in_reward)
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Returns (rewards [N], NaN where unscorable; advantages [N], never NaN; stats) with TRL's metric names.

    estimator (sum_then_normalize only) replaces the group standardization by verl's RLOO or REINFORCE++
    estimators (outcome_advantages)."""
    _check_arguments(rewards_per_func, weights, group_size, aggregation, scale_rewards, eps, names)
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if estimator != "grpo" and aggregation != "sum_then_normalize":
        raise ValueError(f"estimator {estimator!r} needs aggregation 'sum_then_normalize' (GDPO's normalize_then_sum "
                         "is its own estimator)")
    if penalty is not None and (aggregation != "sum_then_normalize" or penalty.shape != rewards_per_func.shape[:1]):
        raise ValueError(f"penalty must be [N] = ({rewards_per_func.shape[0]},) with aggregation "
                         f"'sum_then_normalize', got {tuple(penalty.shape)} with {aggregation!r}")
    weights = weights.to(rewards_per_func)
    unscorable = rewards_per_func.isnan().all(dim=1)
    rewards = (rewards_per_func * weights).nansum(dim=1).masked_fill(unscorable, math.nan)
    shaped = rewards + penalty.to(rewards) if penalty is not None else rewards  # the reward the advantages see
    if estimator != "grpo":
        advantages = outcome_advantages(shaped, group_size, estimator, lengths)
    elif aggregation == "sum_then_normalize":
        advantages = _center_and_scale(shaped.unsqueeze(1), group_size, scale_rewards, eps).squeeze(1)
    else:
        advantages = _decoupled_advantages(rewards_per_func, weights, unscorable, group_size, eps)
    advantages = advantages.nan_to_num(nan=0.0)  # unscorable rows: no learning signal
    names = names if names is not None else [str(index) for index in range(rewards_per_func.shape[1])]
    stats = _reward_stats(rewards, rewards_per_func, group_size, names)
    if penalty is not None:
        stats["rewards/kl_penalty/mean"] = penalty.mean().item()
    return rewards, advantages, stats


def outcome_advantages(rewards: torch.Tensor,  # [N], NaN where unscorable
                       group_size: int, estimator: str, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """verl's outcome-reward estimators (verl/trainer/ppo/core_algos.py), [N], NaN on unscorable rows.

    rloo (arXiv 2402.14740): r_i minus the mean of the group's other scored rewards, i.e.
    n / (n - 1) x (r_i - group mean); 0 in a group with fewer than two scored rewards (no baseline left;
    verl gives such a lone completion its raw reward).
    reinforce_plus_plus (arXiv 2501.03262): no baseline; the rewards whitened over the batch's tokens, each
    completion's reward counted once per completion token (verl's masked_whiten: mean and unbiased variance
    over tokens, (r - mean) / sqrt(var + 1e-8)). With outcome rewards and gamma 1 every token of a
    completion carries its reward, so the per-token advantage is one value per completion.
    reinforce_plus_plus_baseline: the group mean subtracted first, then the same whitening (which moves
    groups of equal rewards off exact 0: zero-advantage filtering finds no rows to drop there)."""
    num_rows = rewards.shape[0]
    grouped = rewards.view(num_rows // group_size, group_size)
    if estimator == "rloo":
        scored = (~grouped.isnan()).sum(dim=1, keepdim=True)
        leave_one_out = _center(grouped, dim=1) * scored / (scored - 1).clamp(min=1)
        return torch.where(scored >= 2, leave_one_out, torch.where(grouped.isnan(), math.nan, 0.0)).reshape(num_rows)
    if lengths is None or tuple(lengths.shape) != (num_rows,):
        raise ValueError(f"{estimator} whitens over tokens: lengths must be [N] = ({num_rows},) completion token "
                         f"counts, got {None if lengths is None else tuple(lengths.shape)}")
    values = _center(grouped, dim=1).reshape(num_rows) if estimator == "reinforce_plus_plus_baseline" else rewards
    return _token_whiten(values, lengths.to(values))


def _token_whiten(values: torch.Tensor,  # [N], NaN on unscorable rows
                  lengths: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten of values repeated lengths[i] times: (v - mean) / sqrt(unbiased var + 1e-8);
    0 for a batch of fewer than two scored tokens."""
    weights = torch.where(values.isnan(), 0.0, lengths)
    total = weights.sum()
    if total < 2:  # no variance to divide by (verl raises); such a batch carries no signal
        return torch.where(values.isnan(), math.nan, 0.0)
    filled = values.nan_to_num(nan=0.0)
    mean = (filled * weights).sum() / total
    variance = ((filled - mean) ** 2 * weights).sum() / total * total / (total - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def standardize_groups(grouped: torch.Tensor,  # [P, G, ...], may hold NaN
                       eps: float = 1e-4) -> torch.Tensor:
    """(r - mean) / (unbiased std + eps) along the group dim (1) over the non-NaN values; exactly 0 in a
    group of equal values (or of a single value), NaN stays NaN. GRPO's group normalization, also
    EBFT's group_norm."""
    return _center(grouped, dim=1) / (_nanstd(grouped, dim=1) + eps)


def _decoupled_advantages(rewards_per_func: torch.Tensor,  # [N, F], NaN where a function returned None
                          weights: torch.Tensor,  # [F]
                          unscorable: torch.Tensor,  # [N] bool: every function returned None
                          group_size: int, eps: float) -> torch.Tensor:
    """GDPO: per function, group z-scores; their weighted sum (None counts 0) divided by its batch std
    (+ eps). [N], NaN on unscorable rows.

    TRL also subtracts the batch mean of the sum. That mean is 0 in exact arithmetic (each function's
    centred rewards add up to 0 over a group's scored rows, unscorable rows add nothing), so it is left
    out: subtracting its rounding noise (~1e-8 in float32) would give groups without signal a non-zero
    advantage, and zero-advantage filtering relies on their exact zeros."""
    num_rows, num_functions = rewards_per_func.shape
    grouped = rewards_per_func.view(num_rows // group_size, group_size, num_functions)
    z_scores = standardize_groups(grouped, eps)
    summed = (z_scores.reshape(num_rows, num_functions) * weights).nansum(dim=1).masked_fill(unscorable, math.nan)
    return summed / (_nanstd(summed.unsqueeze(1), dim=0).squeeze(1) + eps)


def _center_and_scale(values: torch.Tensor,  # [N, F], may hold NaN
                      group_size: int, scale_rewards: str, eps: float) -> torch.Tensor:
    """Per column: subtract the group's mean, divide by the group's or batch's std (+ eps). NaN stays NaN."""
    num_rows, num_columns = values.shape
    grouped = values.view(num_rows // group_size, group_size, num_columns)
    centered = _center(grouped, dim=1)
    if scale_rewards == "group":
        centered = centered / (_nanstd(grouped, dim=1) + eps)
    elif scale_rewards == "batch":
        centered = centered / (_nanstd(values, dim=0) + eps)
    return centered.reshape(num_rows, num_columns)


def _center(values: torch.Tensor, dim: int) -> torch.Tensor:
    """values minus their nanmean along dim; NaN stays NaN.

    Exactly 0 where all valid values along dim are equal: floating point does not promise it (three
    fp64 0.1s have mean 0.1 + 1.4e-17, three fp32 0.45s have torch.std 3.7e-8), yet an exact 0 is what
    lets the loop skip groups with no signal and frac_reward_zero_std count them.
    """
    valid = ~values.isnan()
    smallest = torch.where(valid, values, torch.inf).amin(dim, keepdim=True)
    largest = torch.where(valid, values, -torch.inf).amax(dim, keepdim=True)
    centered = values - values.nanmean(dim, keepdim=True)
    return torch.where(valid & (smallest == largest), 0.0, centered)


def _nanstd(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased std (as torch.std) over the non-NaN values along dim, kept as a size-1 dim.

    0 where fewer than two values are valid (torch.std gives NaN, which must not reach the
    advantages): their deviations are all exactly 0 and the clamp keeps count - 1 off zero.
    """
    valid = ~values.isnan()
    count = valid.sum(dim, keepdim=True)
    squared_deviations = torch.where(valid, _center(values, dim) ** 2, 0.0)
    return (squared_deviations.sum(dim, keepdim=True) / (count - 1).clamp(min=1)).sqrt()


def _reward_stats(rewards: torch.Tensor,  # [N], NaN on unscorable rows
                  rewards_per_func: torch.Tensor,  # [N, F]
                  group_size: int, names: list[str]) -> dict[str, float]:
    """TRL's reward metrics over the scored values; a std of fewer than two values is NaN, as TRL's nanstd
    gives (logged as null). reward_std is the mean of the groups' stds (TRL: the batch's std; see
    docs/trl-differences.md), frac_reward_zero_std the fraction of groups whose std is 0 (a group with
    fewer than two scored completions has no std: not counted, as in TRL)."""
    group_std = _std_or_nan(rewards.view(-1, group_size), dim=1)
    stats = {
        "reward": rewards.nanmean().item(),
        "reward_std": group_std.nanmean().item(),
        "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).double().mean().item(),
    }
    means = rewards_per_func.nanmean(dim=0).tolist()
    stds = _std_or_nan(rewards_per_func, dim=0).squeeze(0).tolist()
    for name, mean, std in zip(names, means, stds):
        stats[f"rewards/{name}/mean"] = mean
        stats[f"rewards/{name}/std"] = std
    return stats


def _std_or_nan(values: torch.Tensor, dim: int) -> torch.Tensor:
    """_nanstd, but NaN where fewer than two values are valid (a statistic, not a divisor)."""
    count = (~values.isnan()).sum(dim, keepdim=True)
    return torch.where(count >= 2, _nanstd(values, dim), math.nan)


def _check_arguments(rewards_per_func, weights, group_size, aggregation, scale_rewards, eps, names) -> None:
    if rewards_per_func.dim() != 2 or not rewards_per_func.is_floating_point():
        raise ValueError(f"rewards_per_func must be a float tensor of shape [N, F], got "
                         f"{rewards_per_func.dtype} of shape {tuple(rewards_per_func.shape)}")
    num_completions, num_functions = rewards_per_func.shape
    if tuple(weights.shape) != (num_functions,):
        raise ValueError(f"weights must have shape [F] = ({num_functions},) to match rewards_per_func, "
                         f"got {tuple(weights.shape)}")
    if group_size < 1 or num_completions == 0 or num_completions % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of completions "
                         f"N={num_completions} (rows of rewards_per_func) into whole groups")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if scale_rewards not in REWARD_SCALINGS:
        raise ValueError(f"scale_rewards must be one of {REWARD_SCALINGS}, got {scale_rewards!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps the division by a zero std finite), got {eps}")
    if names is not None and len(names) != num_functions:
        raise ValueError(f"names must have one entry per reward function ({num_functions}), got {len(names)}")
    if rewards_per_func.isinf().any():
        raise ValueError("rewards_per_func holds an infinite reward; reward functions must return finite "
                         "floats or None")
