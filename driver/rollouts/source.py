"""BatchSource: what the loop (driver/train.py) takes its batches from, one per optimizer step.

Implemented by feed.Rollouts (vLLM generates), distributed_feed.LeaderFeed / FollowerFeed (the
same under torchrun, per rank) and EBFT's strided StridedSource (the trainer samples:
driver/ebft/strided.py, reached through driver/algorithms.py's TrainerSampling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class BatchSource(Protocol):
    def next_batch(self, step: int, abandon: Callable[[], bool] = ...) -> Any | None:
        """The batch that optimizer step `step` + 1 trains on (the algorithm's update takes it), or
        None when the run ends early; `abandon()` true: stop waiting (Ctrl-C). The loop reads its
        `metrics`, `samples` (printed) and `table` (the completions table) besides."""

    def push(self, step: int) -> dict[str, float]:
        """After `step` updates: the sampler gets the new adapter. Returns metrics of the push."""

    def evaluate(self, step: int) -> Any | None:
        """After `step` updates and their push: the eval section's driver.rollouts.evaluation.Evaluation of the
        adapter, or None (no evaluation configured, or not this rank's to run)."""

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps to resume the same stream of batches (None: nothing, a follower rank)."""

    def close(self) -> None:
        """Stops background work (the prefetch thread, reward workers) before the engine shuts down."""
