"""Rewards -> advantages: weight the reward functions, then centre and scale within each prompt's group.

GRPO (DeepSeekMath, https://arxiv.org/abs/2402.03300) replaces PPO's value network by the group of G
completions sampled for the same prompt: advantage = (r - mean_group(r)) / std_group(r).
`scale_rewards` picks the divisor as TRL's GRPOTrainer does: the group's std ("group"), the whole
batch's std ("batch"), or none at all ("none", Dr. GRPO https://arxiv.org/abs/2503.20783, which shows
the division up-weights prompts that are too easy or too hard).

`aggregation` says when the reward functions are combined: "sum_then_normalize" weights and sums them
first (TRL's default); "normalize_then_sum" centres and scales each function on its own, so a
function with a large range cannot drown the others, then sums the weighted results.

Layout: N = P prompts x G completions, grouped contiguously (group g is rows g*G .. g*G+G-1).
A reward function returns None (NaN here) for completions it does not apply to; NaN is ignored by
every mean and std and counts as 0 in weighted sums, so advantages are never NaN.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
REWARD_SCALINGS = ("group", "batch", "none")


def combine_rewards(
    rewards_per_func: torch.Tensor,  # [N, F] float; NaN where a reward function returned None
    weights: torch.Tensor,  # [F]
    group_size: int,
    aggregation: str,
    scale_rewards: str,
    eps: float = 1e-4,
    names: list[str] | None = None,  # [F] names for the per-function stats; default "0", "1", ...
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Returns (rewards [N], advantages [N], stats) with TRL's metric names."""
    _check_arguments(rewards_per_func, weights, group_size, aggregation, scale_rewards, eps, names)
    weights = weights.to(rewards_per_func)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    if aggregation == "sum_then_normalize":
        advantages = _center_and_scale(rewards.unsqueeze(1), group_size, scale_rewards, eps).squeeze(1)
    else:
        normalized = _center_and_scale(rewards_per_func, group_size, scale_rewards, eps)
        advantages = (normalized * weights).nansum(dim=1)
    names = names if names is not None else [str(index) for index in range(rewards_per_func.shape[1])]
    return rewards, advantages, _reward_stats(rewards, rewards_per_func, group_size, names)


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


def _reward_stats(rewards: torch.Tensor,  # [N]
                  rewards_per_func: torch.Tensor,  # [N, F]
                  group_size: int, names: list[str]) -> dict[str, float]:
    group_std = _nanstd(rewards.view(-1, group_size), dim=1)
    zero_std_groups = torch.isclose(group_std, torch.zeros_like(group_std)).sum().item()
    stats = {
        "reward": rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": zero_std_groups / group_std.numel(),
    }
    means = rewards_per_func.nanmean(dim=0).tolist()
    stds = _nanstd(rewards_per_func, dim=0).squeeze(0).tolist()
    for name, mean, std in zip(names, means, stds):
        stats[f"rewards/{name}/mean"] = mean
        stats[f"rewards/{name}/std"] = std
    return stats


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
