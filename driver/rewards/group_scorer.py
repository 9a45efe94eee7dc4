"""Rewards by group id, for the rollout pipeline: submitted by whichever thread sees a group finish,
collected by the trainer's thread when it assembles the step.

The worker pool (driver/rewards/pool.py) hands queued calls to free workers only while someone
calls into it; with prefetch the trainer is busy updating while groups queue, so a pump thread
keeps the workers fed and collects their answers. Scoring in this process (reward_num_workers = 0)
happens at submit, in the submitting thread: driver/rollouts/feed.py submits from the main thread then.
"""

from __future__ import annotations

import threading

import torch

from driver.config import Config
from driver.data.records import Group
from driver.rewards.advantages import combine_rewards
from driver.rewards.functions import group_call, warn_unscorable
from driver.rewards.pool import RewardPool, RewardResult, make_reward_scorer

POLL_S = 0.01  # how often the pump feeds the workers and reads their answers


class GroupScorer:
    """The reward functions as a Scorer (driver/rewards/scorer.py): GRPO's."""

    ground_truth_ids = None  # no loss term on ground truths

    def __init__(self, config: Config) -> None:
        self.config = config
        self.scorer = make_reward_scorer(config.rewards, config.rewards.reward_num_workers,
                                         config.rewards.reward_timeout, config.model.device)
        self.names, self.weights = self.scorer.names, self.scorer.weights
        self.in_workers = isinstance(self.scorer, RewardPool)
        self._condition = threading.Condition()  # guards the pool and everything below
        self._done: dict[int, RewardResult] = {}
        self._unwanted: set[int] = set()  # submitted, then dropped (stale): their results are thrown away
        self._outstanding = 0  # submitted, not answered yet
        self._closed = False
        self._error: BaseException | None = None
        self._pump = None
        if self.in_workers:
            self._pump = threading.Thread(target=self._run_pump, name="reward-pump", daemon=True)
            self._pump.start()

    def advantages(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """The weighted reward per completion and its advantage (combine_rewards: algo.advantage_estimator)."""
        unscorable = float(warn_unscorable(groups))  # all None: advantage 0
        table = torch.cat([group.rewards for group in groups])
        algo = self.config.algo
        lengths = torch.tensor([len(sample.token_ids) for group in groups for sample in group.samples],
                               dtype=torch.float32)
        total, advantages, stats = combine_rewards(table, self.weights, algo.num_generations,
                                                   self.config.rewards.aggregation, algo.scale_rewards,
                                                   names=self.names, estimator=algo.advantage_estimator,
                                                   lengths=lengths, penalty=kl_penalties(groups))
        return total, advantages, {"rewards/unscorable_completions": unscorable, **stats}

    def submit_group(self, group: Group) -> None:
        with self._condition:
            self.scorer.submit(group.group_id, group_call(group, group.texts))
            self._outstanding += 1
            self._collect(0.0)

    def wait(self, keys: list[int]) -> dict[int, RewardResult]:
        with self._condition:
            while not set(keys) <= self._done.keys():
                if self._error is not None:
                    raise self._error
                if self._pump is None:
                    self._collect(0.0)  # inline: answered at submit already
                    if not set(keys) <= self._done.keys():
                        raise KeyError(f"groups {sorted(set(keys) - self._done.keys())} were never submitted")
                else:
                    self._condition.wait(POLL_S)
            return {key: self._done.pop(key) for key in keys}

    def discard(self, keys: list[int]) -> None:
        """Results of these submitted groups will not be waited for."""
        with self._condition:
            for key in keys:
                if self._done.pop(key, None) is None:
                    self._unwanted.add(key)

    def _collect(self, timeout: float) -> None:
        results = self.scorer.poll(timeout)
        for result in results:
            if result.key in self._unwanted:
                self._unwanted.discard(result.key)
            else:
                self._done[result.key] = result
        self._outstanding -= len(results)
        if results:
            self._condition.notify_all()

    def _run_pump(self) -> None:
        while True:
            with self._condition:
                if self._closed:
                    return
                if self._outstanding:
                    try:
                        self._collect(0.0)
                    except BaseException as error:  # noqa: BLE001 - raised to the trainer by wait()
                        self._error = error
                        self._condition.notify_all()
                        return
                # Sleeps with the lock released: a pool call blocking here would starve submitters.
                self._condition.wait(POLL_S)

    def metrics(self) -> dict[str, float]:
        with self._condition:
            return self.scorer.metrics()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._pump is not None:
            self._pump.join()
        self.scorer.close()


def kl_penalties(groups: list[Group]) -> torch.Tensor | None:
    """[N] the groups' KL penalties (algo.kl_in_reward, set at assembly), or None."""
    if all(group.kl_penalty is None for group in groups):
        return None
    return torch.cat([group.kl_penalty for group in groups])


def reward_function_scorer(config: Config, policy=None) -> tuple[GroupScorer, None]:
    """GRPO's scorer factory (driver/algorithms.py): the reward functions; no per-group budget."""
    return GroupScorer(config), None
