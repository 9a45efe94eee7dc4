"""algo.advantage_estimator against verl's definitions (verl/trainer/ppo/core_algos.py and
verl/utils/torch_functional.py, transcribed below on [N, T] token tensors, float64)."""

import math

import pytest
import torch

from driver.rewards.advantages import combine_rewards, outcome_advantages

REWARDS = [1.0, 0.0, 0.5, 0.5, 2.0, -1.0, 0.25, 3.0, 1.0, 1.0, 1.0, 1.0]  # 3 groups of 4; the last all equal
LENGTHS = [5, 3, 7, 1, 2, 6, 4, 4, 3, 8, 2, 5]
GROUP = 4


def verl_masked_whiten(values, mask):
    def masked_mean(v):
        return (v * mask).sum() / (mask.sum() + 1e-8)

    mean = masked_mean(values)
    variance = masked_mean((values - mean) ** 2) * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def token_tensors():
    width = max(LENGTHS)
    mask = (torch.arange(width) < torch.tensor(LENGTHS).unsqueeze(1)).double()
    return torch.tensor(REWARDS, dtype=torch.float64), mask


def verl_rloo(scores):
    out = scores.clone()
    for start in range(0, len(scores), GROUP):
        group = scores[start:start + GROUP]
        n = len(group)
        out[start:start + GROUP] = group * n / (n - 1) - group.mean() * n / (n - 1)
    return out


def verl_reinforce_plus_plus(scores, mask, baseline: bool):
    if baseline:
        scores = scores.clone()
        for start in range(0, len(scores), GROUP):
            scores[start:start + GROUP] -= scores[start:start + GROUP].mean()
    token_scores = scores.unsqueeze(-1) * mask  # outcome reward on every token (gamma 1: the return)
    return verl_masked_whiten(token_scores, mask) * mask


def first_token(values):
    return values[:, 0]


def test_rloo_is_reward_minus_the_others_mean():
    scores, _ = token_tensors()
    advantages = outcome_advantages(scores, GROUP, "rloo")
    torch.testing.assert_close(advantages, verl_rloo(scores))
    for row in range(len(REWARDS)):  # the leave-one-out definition itself
        start = row // GROUP * GROUP
        others = [REWARDS[i] for i in range(start, start + GROUP) if i != row]
        assert advantages[row].item() == pytest.approx(REWARDS[row] - sum(others) / len(others))
    assert torch.all(advantages[8:] == 0)  # equal rewards: exact zeros, which filtering relies on


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_whitens_over_the_batchs_tokens(estimator):
    scores, mask = token_tensors()
    advantages = outcome_advantages(scores, GROUP, estimator, torch.tensor(LENGTHS))
    expected = verl_reinforce_plus_plus(scores, mask, baseline=estimator.endswith("baseline"))
    torch.testing.assert_close(advantages, first_token(expected))
    # every token of a completion carries the same advantage
    torch.testing.assert_close(expected * mask, advantages.unsqueeze(1) * mask)


def test_unscorable_rows_are_left_out_and_get_zero():
    rewards = torch.tensor(REWARDS, dtype=torch.float32).unsqueeze(1)
    rewards[1] = math.nan
    rewards[8:11] = math.nan  # a group with one scored reward: no leave-one-out baseline
    _, advantages, _ = combine_rewards(rewards, torch.ones(1), GROUP, "sum_then_normalize", "group",
                                       estimator="rloo")
    assert advantages[0].item() == pytest.approx(1.0 - 0.5)  # the other scored rewards: 0.5 and 0.5
    assert advantages[1].item() == 0 and torch.all(advantages[8:] == 0)
    assert sum(advantages[[0, 2, 3]].tolist()) == pytest.approx(0.0, abs=1e-6)
    lengths = torch.tensor(LENGTHS, dtype=torch.float32)
    _, whitened, _ = combine_rewards(rewards, torch.ones(1), GROUP, "sum_then_normalize", "group",
                                     estimator="reinforce_plus_plus", lengths=lengths)
    scored = ~rewards[:, 0].isnan()
    weights = lengths * scored
    assert (whitened * weights).sum().item() == pytest.approx(0.0, abs=1e-5)  # token-weighted mean 0
    assert torch.all(whitened[~scored] == 0)


def test_bad_estimator_arguments_are_named():
    rewards = torch.tensor(REWARDS).unsqueeze(1)
    with pytest.raises(ValueError, match="estimator must be one of"):
        combine_rewards(rewards, torch.ones(1), GROUP, "sum_then_normalize", "group", estimator="ppo")
    with pytest.raises(ValueError, match="normalize_then_sum"):
        combine_rewards(rewards, torch.ones(1), GROUP, "normalize_then_sum", "group", estimator="rloo")
    with pytest.raises(ValueError, match="lengths"):
        combine_rewards(rewards, torch.ones(1), GROUP, "sum_then_normalize", "group", estimator="reinforce_plus_plus")
