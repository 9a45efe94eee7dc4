"""The environment's own reward as a reward function: add `driver.environments.rewards.environment_reward`
to rewards.functions when the environment scores its episodes (StepResult.reward at the end). An episode
the environment did not score (it was capped, or the environment gives no reward) gets None, which the
reward table keeps out of the statistics (driver/rewards/functions.py)."""

from __future__ import annotations


def environment_reward(completions: list, environment_reward: list[float | None] | None = None,
                       **columns) -> list[float | None]:
    if environment_reward is None:
        raise ValueError("environment_reward needs an environment (the environment section of the config): "
                         "no episode's reward was passed")
    return list(environment_reward)
