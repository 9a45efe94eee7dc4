"""driver.rewards.advantages.combine_rewards against a float64 oracle written as explicit loops over groups,
following TRL's GRPOTrainer._generate_and_score_completions (trl/trainer/grpo_trainer.py, main as of
2026-07): its nanstd (unbiased, NaN for fewer than two values), eps 1e-4, unscorable rows (every function
None) NaN in the statistics and advantage 0, GDPO's batch standardization of the summed z-scores."""

import math

import pytest
import torch

from driver.rewards.advantages import combine_rewards
from driver.update.losses import all_zero

GROUP_SIZE = 3
NAN = math.nan
# [N = 6 groups x 3, F = 2]: every awkward case in one batch
REWARDS_PER_FUNC = [
    [0.9, 0.2], [0.1, 0.8], [0.4, 0.5],     # group 0: ordinary
    [0.1, 0.7], [0.1, 0.7], [0.1, 0.7],     # group 1: all rewards equal -> advantage 0, zero std
    [0.3, 0.6], [NAN, NAN], [0.8, 0.1],     # group 2: a row where every function returned None
    [0.6, 0.3], [NAN, 0.9], [NAN, 0.2],     # group 3: function 0 has a single valid value
    [0.2, NAN], [0.7, NAN], [0.5, NAN],     # group 4: function 1 is None for the whole group
    [NAN, NAN], [0.4, 0.6], [NAN, NAN],     # group 5: one scorable completion only
]
WEIGHTS = [1.0, 0.5]
AGGREGATION_NAMES = ["sum_then_normalize", "normalize_then_sum"]
SCALE_NAMES = ["group", "batch", "none"]
# (dtype, atol, rtol) against the float64 oracle fed the same (rounded) inputs
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-12, 1e-12)]
# (group size, prompts): several group sizes, odd and even, one group or several
SHAPES = [(2, 5), (3, 1), (5, 3), (7, 2)]


def oracle_mean(values: list[float]) -> float:
    """torch.nanmean of a list: NaN left out, NaN when nothing is left."""
    valid = [value for value in values if not math.isnan(value)]
    return sum(valid) / len(valid) if valid else NAN


def oracle_std(values: list[float]) -> float:
    """TRL's nanstd: unbiased over the non-NaN values, NaN for fewer than two."""
    valid = [value for value in values if not math.isnan(value)]
    if len(valid) < 2:
        return NAN
    mean = oracle_mean(valid)
    return math.sqrt(sum((value - mean) ** 2 for value in valid) / (len(valid) - 1))


def oracle_combine(rewards_per_func, weights, group_size, aggregation, scale, eps=1e-4):
    """TRL's computation, step by step, in Python floats (NaN arithmetic as torch's: NaN spreads)."""
    rows = rewards_per_func.double().tolist()
    weights = weights.double().tolist()
    num_rows, num_functions = len(rows), len(weights)
    groups = [range(start, start + group_size) for start in range(0, num_rows, group_size)]
    unscorable = [all(math.isnan(x) for x in row) for row in rows]
    rewards = [NAN if unscorable[i] else sum(w * x for w, x in zip(weights, rows[i]) if not math.isnan(x))
               for i in range(num_rows)]
    advantages = [NAN] * num_rows
    if aggregation == "sum_then_normalize":
        batch_std = oracle_std(rewards)
        for group in groups:
            mean, group_std = oracle_mean([rewards[i] for i in group]), oracle_std([rewards[i] for i in group])
            for i in group:
                advantages[i] = rewards[i] - mean
                if scale != "none":
                    advantages[i] /= (group_std if scale == "group" else batch_std) + eps
    else:  # GDPO: z-scores per function and group, weighted sum, then standardized over the batch
        summed = [0.0] * num_rows
        for f in range(num_functions):
            for group in groups:
                column = [rows[i][f] for i in group]
                mean, std = oracle_mean(column), oracle_std(column)
                for i in group:
                    z_score = (rows[i][f] - mean) / (std + eps)
                    summed[i] += 0.0 if math.isnan(z_score) else weights[f] * z_score  # nansum
        summed = [NAN if unscorable[i] else summed[i] for i in range(num_rows)]
        batch_mean, batch_std = oracle_mean(summed), oracle_std(summed)
        advantages = [(value - batch_mean) / (batch_std + eps) for value in summed]
    advantages = [0.0 if math.isnan(value) else value for value in advantages]  # nan_to_num
    group_stds = [oracle_std([rewards[i] for i in group]) for group in groups]
    stats = {"reward": oracle_mean(rewards),
             "reward_std": oracle_mean(group_stds),  # ours: the mean of the group stds (TRL: the batch's)
             "frac_reward_zero_std": sum(abs(std) <= 1e-8 for std in group_stds) / len(groups)}  # NaN: False
    for f in range(num_functions):
        stats[f"rewards/{f}/mean"] = oracle_mean([row[f] for row in rows])
        stats[f"rewards/{f}/std"] = oracle_std([row[f] for row in rows])
    return rewards, advantages, stats


def random_rewards(group_size: int, num_prompts: int, seed: int) -> torch.Tensor:
    """[N, 3] rewards in [0, 1) with None (NaN) scattered, some rows all None, one group of equal rewards."""
    generator = torch.Generator().manual_seed(seed)
    num_rows = group_size * num_prompts
    table = torch.rand(num_rows, 3, generator=generator, dtype=torch.float64)
    table[torch.rand(num_rows, 3, generator=generator) < 0.25] = NAN
    table[torch.rand(num_rows, generator=generator) < 0.15] = NAN  # unscorable rows
    table[0] = NAN
    if num_prompts > 1:
        table[group_size:2 * group_size] = torch.tensor([0.25, 0.5, NAN], dtype=torch.float64)
    return table


def assert_matches_oracle(rewards_per_func, weights, group_size, aggregation, scale, atol, rtol):
    rewards, advantages, stats = combine_rewards(rewards_per_func, weights, group_size, aggregation, scale)
    expected_rewards, expected_advantages, expected_stats = oracle_combine(
        rewards_per_func, weights, group_size, aggregation, scale)
    assert not advantages.isnan().any()
    assert rewards.dtype == advantages.dtype == rewards_per_func.dtype
    torch.testing.assert_close(rewards.double(), torch.tensor(expected_rewards, dtype=torch.float64),
                               atol=atol, rtol=rtol, equal_nan=True)
    torch.testing.assert_close(advantages.double(), torch.tensor(expected_advantages, dtype=torch.float64),
                               atol=atol, rtol=rtol)
    assert stats.keys() == expected_stats.keys()
    for key, value in expected_stats.items():
        same = math.isnan(value) if math.isnan(stats[key]) else stats[key] == pytest.approx(value, abs=atol, rel=rtol)
        assert same, (key, stats[key], value)
    return rewards, advantages, stats


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("scale", SCALE_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATION_NAMES)
def test_matches_oracle(aggregation, scale, dtype, atol, rtol):
    rewards_per_func = torch.tensor(REWARDS_PER_FUNC, dtype=dtype)
    weights = torch.tensor(WEIGHTS, dtype=dtype)
    rewards, advantages, stats = assert_matches_oracle(rewards_per_func, weights, GROUP_SIZE, aggregation, scale,
                                                       atol, rtol)
    unscorable = [7, 15, 17]
    assert rewards[unscorable].isnan().all() and (advantages[unscorable] == 0).all()
    assert stats["frac_reward_zero_std"] == pytest.approx(1 / 6)  # group 1 only; group 5 has no std


@pytest.mark.parametrize("scale", SCALE_NAMES)
@pytest.mark.parametrize("aggregation", AGGREGATION_NAMES)
@pytest.mark.parametrize("group_size,num_prompts", SHAPES)
def test_matches_oracle_on_random_shapes(group_size, num_prompts, aggregation, scale):
    rewards_per_func = random_rewards(group_size, num_prompts, seed=group_size * 10 + num_prompts)
    weights = torch.tensor([1.0, -0.7, 2.5], dtype=torch.float64)
    assert_matches_oracle(rewards_per_func, weights, group_size, aggregation, scale, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("scale", SCALE_NAMES)
def test_unscorable_completion_is_left_out_of_its_group(scale):
    """TRL: a completion for which every function returned None is not a reward of 0 for its group."""
    rewards_per_func = torch.tensor([[1.0], [0.0], [NAN], [1.0], [0.0], [0.5]], dtype=torch.float64)
    rewards, advantages, stats = combine_rewards(rewards_per_func, torch.ones(1, dtype=torch.float64), 3,
                                                 "sum_then_normalize", scale)
    assert rewards[2].isnan() and advantages[2] == 0.0
    assert advantages[0] == -advantages[1]  # centred on the two scored rewards only: mean 0.5
    assert stats["reward"] == pytest.approx(2.5 / 5)


def test_normalize_then_sum_standardizes_the_sum_over_the_batch():
    """GDPO: the weighted sum of the per-function group z-scores has batch std 1 (up to eps), whatever
    the weights; without the batch step its scale would follow the weights."""
    rewards_per_func = random_rewards(4, 5, seed=3)
    for weights in ([1.0, 1.0, 1.0], [10.0, 0.1, 3.0]):
        _, advantages, _ = combine_rewards(rewards_per_func, torch.tensor(weights, dtype=torch.float64), 4,
                                           "normalize_then_sum", "group")
        scored = advantages[~rewards_per_func.isnan().all(dim=1)]
        assert scored.std().item() == pytest.approx(1.0, abs=1e-3)


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
    """group_size 1 (or a batch of one): torch.std gives NaN; the advantage must be 0 instead. A group of
    one has no std to report (NaN, logged as null, as TRL's nanstd) and does not count as zero std."""
    rewards_per_func = torch.tensor([[0.5], [0.25]], dtype=torch.float64)
    for aggregation in AGGREGATION_NAMES:
        for scale in SCALE_NAMES:
            _, advantages, stats = combine_rewards(rewards_per_func, torch.ones(1), 1, aggregation, scale)
            assert (advantages == 0).all(), (aggregation, scale, advantages)
            assert math.isnan(stats["reward_std"]) and stats["frac_reward_zero_std"] == 0.0


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
