"""Replay buffer: high-signal groups kept for a while, to refill the places of groups filtered out.

A step loses the groups whose rewards are all equal (their advantages are exactly zero, so they
teach nothing); replaying a group that did carry signal keeps the batch full without generating
more. Groups are ranked by replay_score = sum|A| * std(rewards): how much gradient the group gave
and how spread its outcomes were.

What a replayed group reuses and what the update recomputes:
- reused: its tokens, its samples' sampling (behaviour) logprobs from the engine, its rewards,
  totals and advantages (centred within the group when it was generated).
- recomputed: the old logprobs and the importance ratio. The update always scores every row with
  the current policy (driver/update/step.py: old = the current policy before this step's updates),
  and the IS weight is current / sampling, so for a replayed group it corrects for every version
  since its samples were drawn, not only the engine mismatch.
- the age bound: that ratio grows with the versions between sampling and training, and once it
  is truncated or masked the group's gradient is mostly the cap, not its advantages. TRL's
  replay buffer has no version check, so its behaviour logprobs grow arbitrarily stale; here a
  group older than max_age versions is evicted instead of replayed.

Which groups a step takes (algo.replay_sampling): "best" (ours) the highest scores, and they leave
the buffer, so a group trains at most twice; "proportional" (axolotl's) draws without replacement
with probability proportional to the score, seeded by (train.seed, step), and the drawn groups stay
in the buffer, so a good group can be replayed at several steps until max_age or a better group
evicts it.

Re-padding needs nothing here: a batch keeps tokens as lists (packed into one row without padding
by driver/scoring.pack) and batch_from_groups right-pads the sampling logprobs and the mask to the
width of the batch a group joins, whichever batch it was generated in.
"""

from __future__ import annotations

import copy
import dataclasses
import zlib

import torch

from driver.data.prompts import Prompt
from driver.data.records import Episode, Group, Sample, Span
from driver.data.trainer_state import TrainerState
from driver.rewards.advantages import _nanstd  # the same unbiased, NaN-ignoring std as the advantages
from driver.rollouts.schedule import staleness


REPLAY_SAMPLING = ("best", "proportional")


def replay_score(group: Group) -> float:
    """sum(|advantages|) * std(total rewards): 0 exactly for a group with no signal."""
    if group.advantages is None or group.total is None:
        raise ValueError(f"group {group.group_id}: advantages and total must be set (batch assembly sets "
                         "them) before it can be scored for replay")
    signal = group.advantages.double().abs().nansum()
    spread = _nanstd(group.total.double().unsqueeze(0), dim=1)
    return float(signal * spread.squeeze())


class ReplayBuffer:
    """At most `capacity` groups, none older than `max_age` versions when taken.

    Ranking is (score, group_id): the lowest score is evicted first and, among equal scores, the
    older group (smaller group_id, generated earlier) loses; take() serves in the reverse order.
    """

    def __init__(self, capacity: int, max_age: int, sampling: str = "best", seed: int = 0) -> None:
        if sampling not in REPLAY_SAMPLING:
            raise ValueError(f"sampling must be one of {list(REPLAY_SAMPLING)}, got {sampling!r}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 groups (0 turns replay off), got {capacity}")
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0 versions, got {max_age}")
        self.capacity, self.max_age, self.sampling, self.seed = capacity, max_age, sampling, seed
        self._entries: dict[int, tuple[float, Group]] = {}  # group_id -> (score, group)
        self.evicted_stale = self.evicted_full = self.taken = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, groups: list[Group], step: int) -> int:
        """Offer this step's groups; returns how many of them are in the buffer afterwards.

        Zero-signal groups and groups that were themselves replayed are not kept (a group trains
        at most twice: when generated and once replayed). A group already older than max_age
        counts as a stale eviction: if every group does, max_age is below the schedule's own
        staleness (driver/config.py: schedule_staleness) and replay can never serve anything."""
        self._evict_stale(step)
        offered = set()
        for group in groups:
            if group.replayed:
                continue
            if self._too_old(group, step):
                self.evicted_stale += 1
                continue
            score = replay_score(group)
            if score > 0:  # also False for NaN
                self._entries[group.group_id] = (score, group)
                offered.add(group.group_id)
        ranked = sorted(self._entries, key=self._rank)
        for group_id in ranked[: max(0, len(ranked) - self.capacity)]:
            del self._entries[group_id]
            self.evicted_full += 1
        kept = offered & self._entries.keys()
        for group_id in kept:  # the buffer owns its groups: later edits by the caller do not reach them
            score, group = self._entries[group_id]
            self._entries[group_id] = (score, copy.deepcopy(group))
        return len(kept)

    def take(self, count: int, step: int) -> list[Group]:
        """Up to `count` groups, none older than max_age at `step`: the best ones, which leave the buffer,
        or (proportional) a draw weighted by score, which stays. Returned groups are marked replayed=True;
        the groups passed to add() are never touched (the buffer stored copies of them)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self._evict_stale(step)
        if self.sampling == "best":
            chosen = sorted(self._entries, key=self._rank, reverse=True)[:count]
            taken = [self._entries.pop(group_id)[1] for group_id in chosen]
        else:
            chosen = self._draw(min(count, len(self._entries)), step)
            taken = [copy.deepcopy(self._entries[group_id][1]) for group_id in chosen]
        for group in taken:
            group.replayed = True
        self.taken += len(taken)
        return taken

    def _draw(self, count: int, step: int) -> list[int]:
        """`count` distinct group ids drawn with probability proportional to their scores (axolotl's
        multinomial), from a generator seeded by (seed, step): the same draw after a resume."""
        if count == 0:
            return []
        ids = sorted(self._entries)
        scores = torch.tensor([self._entries[group_id][0] for group_id in ids], dtype=torch.float64)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:replay:{step}".encode()) & 0x7FFFFFFF)
        drawn = torch.multinomial(scores / scores.sum(), count, replacement=False, generator=generator)
        return [ids[index] for index in drawn.tolist()]

    def metrics(self) -> dict[str, float]:
        scores = [score for score, _ in self._entries.values()]
        return {
            "replay/size": float(len(scores)),
            "replay/mean_score": sum(scores) / len(scores) if scores else 0.0,
            "replay/evicted_stale": float(self.evicted_stale),  # cumulative, like the two below
            "replay/evicted_full": float(self.evicted_full),
            "replay/taken": float(self.taken),
        }

    def state_dict(self) -> dict:
        """Plain containers and tensors only, so a checkpoint loads with torch.load(weights_only=True)."""
        return {"groups": [dataclasses.asdict(group) for _, group in self._entries.values()],
                "evicted_stale": self.evicted_stale, "evicted_full": self.evicted_full, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        """Exactly the saved buffer; a capacity smaller than it was takes effect at the next add()."""
        groups = [group_from_dict(fields) for fields in state["groups"]]
        self._entries = {group.group_id: (replay_score(group), group) for group in groups}
        self.evicted_stale = int(state["evicted_stale"])
        self.evicted_full = int(state["evicted_full"])
        self.taken = int(state["taken"])

    def _rank(self, group_id: int) -> tuple[float, int]:
        return self._entries[group_id][0], group_id

    def _too_old(self, group: Group, step: int) -> bool:
        return staleness(step, group.version) > self.max_age

    def _evict_stale(self, step: int) -> None:
        stale = [group_id for group_id, (_, group) in self._entries.items() if self._too_old(group, step)]
        for group_id in stale:
            del self._entries[group_id]
        self.evicted_stale += len(stale)


def group_from_dict(fields: dict) -> Group:
    """The inverse of dataclasses.asdict(group)."""
    samples = [Sample(**{**sample, "spans": [Span(**span) for span in sample["spans"]],
                         "episode": _episode(sample.get("episode"))})
               for sample in fields["samples"]]
    # (a buffer saved before groups carried their trainer_state has none: the default then)
    progress = {"trainer_state": TrainerState(**fields["trainer_state"])} if "trainer_state" in fields else {}
    return Group(**{**fields, "prompt": Prompt(**fields["prompt"]), "samples": samples, **progress})


def _episode(fields: dict | None) -> Episode | None:
    if fields is None:
        return None
    return Episode(**{**fields, "environment_spans": [tuple(span) for span in fields["environment_spans"]]})
