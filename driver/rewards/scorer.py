"""What scores a step's groups, whatever the algorithm: the interface the rollout pipeline talks to.

GRPO's reward functions (driver/rewards/group_scorer.py) and EBFT's feature matching
(driver/ebft/structured.py) both implement it; driver/algorithms.py says which one a run uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from driver.data.prompts import Prompt
from driver.data.records import Group
from driver.rewards.pool import RewardResult


class Scorer(Protocol):
    names: tuple[str, ...] | list[str]  # the reward table's columns
    in_workers: bool  # scores in other processes: groups may be submitted from any thread
    # prompt -> the token ids of its ground truth, which the rollout batch carries for a loss term on them
    # (EBFT's ce_coef, driver/update/ground_truth_loss.py), or None
    ground_truth_ids: Callable[[Prompt], list[int]] | None

    def submit_group(self, group: Group) -> None:
        """Start scoring a finished group (scoring in this process happens here, in this thread)."""

    def wait(self, keys: list[int]) -> dict[int, RewardResult]:
        """The results of the submitted groups with these ids, waiting for those not done."""

    def discard(self, keys: list[int]) -> None:
        """Forget submitted groups (too old to train on): their results are thrown away."""

    def advantages(self, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(total reward [N], advantage [N], metrics) over the step's scored groups, rows in group order."""

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None: ...
