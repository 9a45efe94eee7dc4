"""Reward functions defined with `async def` run concurrently within a call: the fixtures meet at a
two-party barrier, which a sequential await would never pass (it times out after 5 s and fails the
call). Same in the trainer's process, in a worker and through RewardFunctions; a raising coroutine
names its function, as a raising function does."""

import math

import pytest

from driver.config import RewardFunction, RewardsConfig
from driver.rewards.functions import RewardError, RewardFunctions, group_call
from driver.rewards.pool import make_reward_scorer
from tests.driver.rewards.test_driver_reward_pool import make_group

ASYNC = RewardsConfig(functions=[RewardFunction(path="tests.reward_fixtures.async_length"),
                                 RewardFunction(path="tests.reward_fixtures.length_or_none"),
                                 RewardFunction(path="tests.reward_fixtures.async_constant", weight=0.5)])
TEXTS = ["abc", "", "de"]
EXPECTED = [[3.0, 3.0, 1.0], [0.0, math.nan, 1.0], [2.0, 2.0, 1.0]]


def assert_table(table):
    for row, expected in zip(table.tolist(), EXPECTED):
        assert row == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_async_rewards_run_concurrently_in_process_and_in_workers(num_workers, tmp_path):
    scorer = make_reward_scorer(ASYNC, num_workers, 30.0)
    try:
        scorer.submit(7, group_call(make_group(7, TEXTS, tmp_path), TEXTS))
        result = scorer.wait([7])[7]
    finally:
        scorer.close()
    assert result.failure is None, result.failure
    assert_table(result.table)


def test_reward_functions_await_coroutines_together():
    table = RewardFunctions(ASYNC)(prompts=["p"] * 3, completions=TEXTS, columns=[{}] * 3,
                                   completion_ids=[[1]] * 3)
    assert_table(table)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_raising_coroutine_names_its_function(num_workers, tmp_path):
    config = RewardsConfig(functions=[RewardFunction(path="tests.reward_fixtures.length_or_none"),
                                      RewardFunction(path="tests.reward_fixtures.async_raises")])
    scorer = make_reward_scorer(config, num_workers, 30.0)
    try:
        scorer.submit(8, group_call(make_group(8, TEXTS, tmp_path), TEXTS))
        failure = scorer.wait([8])[8].failure
    finally:
        scorer.close()
    assert "reward 'async_raises' raised an exception" in failure and "judge unavailable" in failure
    with pytest.raises(RewardError, match="reward 'async_raises' raised an exception"):
        RewardFunctions(config)(prompts=["p"], completions=["x"], columns=[{}], completion_ids=[[1]])
