"""driver.advantages.combine_rewards against a float64 oracle written as explicit loops over groups."""

import math

import pytest
import torch

from driver.advantages import combine_rewards
from driver.losses import all_zero

GROUP_SIZE = 3
NAN = math.nan
# [N = 5 groups x 3, F = 2]: every awkward case in one batch
REWARDS_PER_FUNC = [
    [0.9, 0.2], [0.1, 0.8], [0.4, 0.5],     # group 0: ordinary
    [0.1, 0.7], [0.1, 0.7], [0.1, 0.7],     # group 1: all rewards equal -> advantage 0, zero std
    [0.3, 0.6], [NAN, NAN], [0.8, 0.1],     # group 2: a row where every function returned None
    [0.6, 0.3], [NAN, 0.9], [NAN, 0.2],     # group 3: function 0 has a single valid value
    [0.2, NAN], [0.7, NAN], [0.5, NAN],     # group 4: function 1 is None for the whole group
]
WEIGHTS = [1.0, 0.5]
AGGREGATION_NAMES = ["sum_then_normalize", "normalize_then_sum"]
SCALE_NAMES = ["group", "batch", "none"]
# (dtype, atol, rtol) against the float64 oracle fed the same (rounded) inputs
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-12)]


def oracle_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else NAN


def oracle_std(values: list[float]) -> float:
    """Unbiased; 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mean = oracle_mean(values)
    return math.sqrt(sum((value - mean) ** 2 for value in values) / (len(values) - 1))


def oracle_center_and_scale(column: list[float], group_size: int, scale: str, eps: float) -> list[float]:
    batch_std = oracle_std([value for value in column if not math.isnan(value)])
    out = []
    for start in range(0, len(column), group_size):
        group = column[start:start + group_size]
        valid = [value for value in group if not math.isnan(value)]
        divisor = {"group": oracle_std(valid) + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        out += [value if math.isnan(value) else (value - oracle_mean(valid)) / divisor for value in group]
    return out


def oracle_combine(rewards_per_func, weights, group_size, aggregation, scale, eps=1e-4):
    rows = rewards_per_func.double().tolist()
    weights = weights.double().tolist()
    num_rows, num_functions = len(rows), len(weights)
    rewards = [sum(w * x for w, x in zip(weights, row) if not math.isnan(x)) for row in rows]
    if aggregation == "sum_then_normalize":
        advantages = oracle_center_and_scale(rewards, group_size, scale, eps)
    else:
        columns = [oracle_center_and_scale([row[f] for row in rows], group_size, scale, eps)
                   for f in range(num_functions)]
        advantages = [sum(weights[f] * columns[f][i] for f in range(num_functions) if not math.isnan(columns[f][i]))
                      for i in range(num_rows)]
    group_stds = [oracle_std(rewards[start:start + group_size]) for start in range(0, num_rows, group_size)]
    stats = {"reward": oracle_mean(rewards), "reward_std": oracle_mean(group_stds),
             "frac_reward_zero_std": sum(abs(std) <= 1e-8 for std in group_stds) / len(group_stds)}
    for f in range(num_functions):
        valid = [row[f] for row in rows if not math.isnan(row[f])]
        stats[f"rewards/{f}/mean"] = oracle_mean(valid)
        stats[f"rewards/{f}/std"] = oracle_std(valid)
    return rewards, advantages, stats


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("scale", SCALE_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATION_NAMES)
def test_matches_oracle(aggregation, scale, dtype, atol, rtol):
    rewards_per_func = torch.tensor(REWARDS_PER_FUNC, dtype=dtype)
    weights = torch.tensor(WEIGHTS, dtype=dtype)
    rewards, advantages, stats = combine_rewards(rewards_per_func, weights, GROUP_SIZE, aggregation, scale)
    expected_rewards, expected_advantages, expected_stats = oracle_combine(
        rewards_per_func, weights, GROUP_SIZE, aggregation, scale)

    assert not advantages.isnan().any()
    assert rewards.dtype == advantages.dtype == dtype
    torch.testing.assert_close(rewards.double(), torch.tensor(expected_rewards, dtype=torch.float64),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(advantages.double(), torch.tensor(expected_advantages, dtype=torch.float64),
                               atol=atol, rtol=rtol)
    torch.testing.assert_close(stats, expected_stats, atol=atol, rtol=rtol)
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 5)  # group 1 only


@pytest.mark.parametrize("scale", SCALE_NAMES)
def test_sum_then_normalize_matches_trl_formula(scale):
    """Without NaN, TRL's GRPOTrainer computes advantages with torch.std; the result must be the same."""
    torch.manual_seed(0)
    rewards_per_func = torch.rand(4 * GROUP_SIZE, 2, dtype=torch.float64)
    weights = torch.tensor([0.7, -1.3], dtype=torch.float64)
    rewards, advantages, stats = combine_rewards(rewards_per_func, weights, GROUP_SIZE,
                                                 "sum_then_normalize", scale)

    trl_rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    grouped = trl_rewards.view(-1, GROUP_SIZE)
    trl_advantages = trl_rewards - grouped.mean(dim=1).repeat_interleave(GROUP_SIZE)
    if scale == "group":
        trl_advantages = trl_advantages / (grouped.std(dim=1).repeat_interleave(GROUP_SIZE) + 1e-4)
    elif scale == "batch":
        trl_advantages = trl_advantages / (trl_rewards.std() + 1e-4)
    torch.testing.assert_close(rewards, trl_rewards, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(advantages, trl_advantages, atol=1e-12, rtol=1e-12)
    assert stats["reward_std"] == pytest.approx(grouped.std(dim=1).mean().item(), abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", SCALE_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATION_NAMES)
def test_groups_of_equal_rewards_get_exactly_zero_advantage(aggregation, scale, dtype):
    # Plain centring leaves ~1e-17 (fp64 0.1s) or ~3e-8 (fp32 0.45s), which 1 / eps scales up
    rewards_per_func = torch.tensor([[0.1, 0.7]] * 3 + [[0.3, 0.3]] * 3 + [[0.1, NAN]] * 3, dtype=dtype)
    weights = torch.tensor(WEIGHTS, dtype=dtype)
    _, advantages, stats = combine_rewards(rewards_per_func, weights, GROUP_SIZE, aggregation, scale)
    assert (advantages == 0).all(), advantages
    assert all_zero(advantages)
    assert stats["frac_reward_zero_std"] == 1.0

    rewards_per_func[0, 0] = 0.2  # one group with a signal
    _, advantages, stats = combine_rewards(rewards_per_func, weights, GROUP_SIZE, aggregation, scale)
    assert not all_zero(advantages)
    assert (advantages[GROUP_SIZE:] == 0).all()
    assert stats["frac_reward_zero_std"] == pytest.approx(2 / 3)


def test_single_completion_groups_are_not_nan():
    """group_size 1 (or a batch of one): torch.std gives NaN; the advantage must be 0 instead."""
    rewards_per_func = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    for aggregation in AGGREGATION_NAMES:
        for scale in SCALE_NAMES:
            _, advantages, stats = combine_rewards(rewards_per_func, torch.ones(1), 1, aggregation, scale)
            assert (advantages == 0).all(), (aggregation, scale, advantages)
            assert stats["reward_std"] == 0.0


def test_names_label_the_per_function_stats():
    rewards_per_func = torch.tensor(REWARDS_PER_FUNC)
    _, _, stats = combine_rewards(rewards_per_func, torch.tensor(WEIGHTS), GROUP_SIZE, "sum_then_normalize",
                                  "group", names=["format", "accuracy"])
    assert set(stats) == {"reward", "reward_std", "frac_reward_zero_std", "rewards/format/mean",
                          "rewards/format/std", "rewards/accuracy/mean", "rewards/accuracy/std"}
    _, _, expected = oracle_combine(rewards_per_func, torch.tensor(WEIGHTS), GROUP_SIZE, "sum_then_normalize",
                                    "group")
    assert stats["rewards/accuracy/mean"] == pytest.approx(expected["rewards/1/mean"], abs=1e-6)


BAD_ARGUMENTS = [
    (dict(rewards_per_func=torch.zeros(6)), "rewards_per_func"),
    (dict(rewards_per_func=torch.zeros(6, 2, dtype=torch.int64)), "rewards_per_func"),
    (dict(rewards_per_func=torch.full((6, 2), math.inf)), "rewards_per_func"),
    (dict(rewards_per_func=torch.zeros(7, 2)), "group_size"),
    (dict(group_size=0), "group_size"),
    (dict(weights=torch.ones(3)), "weights"),
    (dict(aggregation="sum"), "aggregation"),
    (dict(scale_rewards="std"), "scale_rewards"),
    (dict(eps=0.0), "eps"),
    (dict(names=["only_one"]), "names"),
]


@pytest.mark.parametrize("overrides,argument", BAD_ARGUMENTS, ids=[arg for _, arg in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(overrides, argument):
    arguments = dict(rewards_per_func=torch.zeros(6, 2), weights=torch.ones(2), group_size=GROUP_SIZE,
                     aggregation="sum_then_normalize", scale_rewards="group")
    with pytest.raises(ValueError, match=argument):
        combine_rewards(**(arguments | overrides))
