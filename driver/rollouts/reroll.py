"""Deferred re-roll: a prompt whose group failed entirely comes back later in training.

A group whose samples are all wrong has zero advantages and teaches nothing now, but the same
prompt may be solvable once the policy has learned more; rolling it again at once would most
likely fail the same way. So it is queued to return delay_steps optimizer steps later, at most
max_attempts rolls in all, and the queue is bounded so that a run of hard prompts cannot crowd
fresh ones out of every batch.

`attempts` counts the rolls of one lineage: a fresh draw of the prompt from the data source
starts again at 1 (Group.attempts), each re-roll adds one.
"""

from __future__ import annotations

import dataclasses

from driver.data.prompts import Prompt
from driver.data.records import Group


def failed_entirely(group: Group, threshold: float) -> bool:
    """Every sample scored at or below threshold (NaN counts as failed), or scoring itself failed."""
    if group.failure is not None:
        return True
    if group.total is None:
        raise ValueError(f"group {group.group_id}: total must be set (batch assembly sets it) to tell "
                         "whether it failed entirely")
    return not bool((group.total > threshold).any())  # NaN > threshold is False: failed


def delay_steps(fraction: float, total_steps: int) -> int:
    """The re-roll delay in optimizer steps for a fraction of the run's train.steps, at least 1."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1] (of train.steps), got {fraction}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    return max(1, round(fraction * total_steps))


@dataclasses.dataclass
class _Waiting:
    due_step: int  # the optimizer step from which the prompt may be rolled again
    order: int  # push order, the tie-break among prompts due at the same step
    prompt: Prompt
    attempts: int  # the roll this will be (the failed group's attempts + 1)


class RerollQueue:
    def __init__(self, delay_steps: int, max_attempts: int, capacity: int, start_step: int = 0,
                 per_step: int | None = None) -> None:
        """start_step: nothing is served before it; per_step: at most this many prompts per step
        (axolotl's reroll_start_fraction x steps and reroll_max_groups)."""
        if delay_steps < 1:
            raise ValueError(f"delay_steps must be >= 1 (a prompt re-rolled at once fails the same way), "
                             f"got {delay_steps}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 rolls per prompt (1: never re-roll), got {max_attempts}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 prompts (0 turns re-roll off), got {capacity}")
        if per_step is not None and per_step < 1:
            raise ValueError(f"per_step must be >= 1 prompts (or None: no limit), got {per_step}")
        self.delay_steps, self.max_attempts, self.capacity = delay_steps, max_attempts, capacity
        self.start_step, self.per_step = start_step, per_step
        self._waiting: list[_Waiting] = []  # in push order
        self._pushed = 0  # pushes accepted so far: the next _Waiting.order
        self.given_up = self.dropped_full = self.rerolled = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, group: Group, step: int) -> bool:
        """Queue the group's prompt to return at step + delay_steps; False if it has had its
        max_attempts rolls (given up) or the queue is full (dropped)."""
        if group.attempts >= self.max_attempts:
            self.given_up += 1
            return False
        if len(self._waiting) >= self.capacity:
            self.dropped_full += 1
            return False
        self._waiting.append(_Waiting(step + self.delay_steps, self._pushed, group.prompt, group.attempts + 1))
        self._pushed += 1
        return True

    def due(self, step: int, limit: int) -> list[tuple[Prompt, int]]:
        """At most `limit` (prompt, attempts) whose step has come, oldest due first, ties in push
        order; they leave the queue."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        if step < self.start_step:
            return []
        if self.per_step is not None:
            limit = min(limit, self.per_step)
        ready = sorted((entry for entry in self._waiting if entry.due_step <= step),
                       key=lambda entry: (entry.due_step, entry.order))[:limit]
        served = {entry.order for entry in ready}
        self._waiting = [entry for entry in self._waiting if entry.order not in served]
        self.rerolled += len(ready)
        return [(entry.prompt, entry.attempts) for entry in ready]

    def metrics(self) -> dict[str, float]:
        return {
            "reroll/queued": float(len(self._waiting)),  # waiting now; the three below are cumulative
            "reroll/given_up": float(self.given_up),
            "reroll/dropped_full": float(self.dropped_full),
            "reroll/rerolled": float(self.rerolled),
        }

    def state_dict(self) -> dict:
        """Plain containers only, so a checkpoint loads with torch.load(weights_only=True)."""
        return {"waiting": [dataclasses.asdict(entry) for entry in self._waiting], "pushed": self._pushed,
                "given_up": self.given_up, "dropped_full": self.dropped_full, "rerolled": self.rerolled}

    def load_state_dict(self, state: dict) -> None:
        """Exactly the saved queue; a capacity smaller than it was only refuses new pushes."""
        self._waiting = [_Waiting(**{**entry, "prompt": Prompt(**entry["prompt"])}) for entry in state["waiting"]]
        self._pushed = int(state["pushed"])
        self.given_up = int(state["given_up"])
        self.dropped_full = int(state["dropped_full"])
        self.rerolled = int(state["rerolled"])
