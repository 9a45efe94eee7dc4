"""Rollouts under torchrun: rank 0 generates, every rank trains its shard.

Rank 0 runs driver/rollouts/feed.py unchanged (vLLM, rewards, prefetch thread, filtering, replay: one
controller, so a 2-process run samples and scores exactly what a 1-process run does), then sends
each rank its shard (driver/rollouts/shard_batch.py) from the main thread. The adapter sync is a sequence of
collectives every rank joins in the same order: the sharded adapter is gathered (rank 0 writes it
and makes vLLM serve it), the probe forward runs on every rank (FSDP), and rank 0's outcome is
broadcast so all ranks agree on the version or fail together. Rank 0's errors and Ctrl-C travel in
the same messages, so no rank is left waiting in a collective. Work that rank 0's scoring needs from
the sharded model (EBFT's features: forwards every rank must join) is sent the same way, as a
"collective" message the other ranks serve while they wait for their shard (on_all_ranks).

Why rank 0 and not every rank against the server: the rollout state (groups in flight, re-roll and
replay queues, staleness, reward workers) is one stateful controller; per-rank generation would need
collectives for every decision it makes, and the runs would no longer match the single process.
"""

from __future__ import annotations

from driver.config import Config
from driver.distributed import world as distributed
from driver.engine import RolloutError
from driver.engine import adapter_sync as sync
from driver.policy.model import Policy
from driver.rollouts.evaluation import Evaluation
from driver.rollouts.filtering import check_every_row_kept
from driver.rollouts.schedule import sync_due
from driver.rollouts.shard_batch import shard_batch


def on_rank0(action, what: str):
    """action() on rank 0 (None elsewhere); when it fails, every rank fails with its message instead
    of waiting for rank 0 in the next collective."""
    if not distributed.world().is_main:
        _raise_if(distributed.broadcast())
        return None
    try:
        result = action()
    except Exception as error:
        distributed.broadcast(f"rank 0 could not {what}: {error}")
        raise
    distributed.broadcast(None)
    return result


def on_all_ranks(work, payloads: list, config: Config, policy: Policy) -> list:
    """work(config, policy, payloads[r]) on every rank r, started from rank 0's main thread while the
    other ranks wait for their shard (FollowerFeed.next_batch); the results in rank order, on rank 0.
    `work` is a module-level function (pickled by name) whose collectives every rank runs in the same
    order, e.g. FSDP forwards padded to the busiest rank's count. A rank whose work raised reports it
    through the gather instead of leaving the others in a collective; rank 0 then raises."""
    world = distributed.world()
    if not world.distributed:
        return [work(config, policy, payloads[0])]
    if len(payloads) != world.size:
        raise ValueError(f"on_all_ranks needs one payload per rank ({world.size}), got {len(payloads)}")
    distributed.scatter([("collective", (work, payload)) for payload in payloads])
    results = distributed.gather(_run_reporting(work, config, policy, payloads[0]))
    failures = [f"rank {rank}: {result.message}" for rank, result in enumerate(results)
                if isinstance(result, WorkFailed)]
    if failures:
        raise RolloutError(f"{getattr(work, '__name__', 'work')} failed on {'; '.join(failures)}")
    return results


class WorkFailed:
    def __init__(self, message: str) -> None:
        self.message = message


def _run_reporting(work, config: Config, policy: Policy, payload):
    try:
        return work(config, policy, payload)
    except Exception as error:  # reported through the gather; rank 0 raises it
        return WorkFailed(f"{type(error).__name__}: {error}")


class LeaderFeed:
    """Rank 0: the Rollouts, whose batches and sync outcomes it shares."""

    def __init__(self, rollouts_factory) -> None:
        """rollouts_factory(before_first_push) -> Rollouts. Its constructor pushes the start version, a
        collective: the other ranks first learn that rank 0 got that far, then the push's outcome.
        A failure broadcasts its message in place of whichever of the two is due."""
        def before_first_push() -> None:
            distributed.broadcast(None)

        try:
            self.rollouts = rollouts_factory(before_first_push)
        except Exception as error:
            distributed.broadcast(f"rank 0 could not start the rollouts: {error}")
            raise
        distributed.broadcast(None)

    def next_batch(self, step: int, abandon=lambda: False):
        world = distributed.world()
        if abandon():
            distributed.scatter([("stop", None)] * world.size)
            return None
        try:
            batch = self.rollouts.next_batch(step, abandon)
            if batch is not None:  # the whole batch: each rank's update sees only its shard
                check_every_row_kept(batch, self.rollouts.config.algo.acts_on_every_completion)
        except Exception as error:
            if abandon():  # Ctrl-C broke the generation: stop cleanly (its prompts come first on resume)
                batch = None
            else:
                distributed.scatter([("error", f"rank 0 failed to produce step {step + 1}'s batch: {error}")]
                                    * world.size)
                raise
        if batch is None:
            distributed.scatter([("stop", None)] * world.size)
            return None
        micro_batch_size = self.rollouts.config.train.micro_batch_size
        shards = [("batch", shard_batch(batch, rank, world.size, micro_batch_size)) for rank in range(world.size)]
        mine = distributed.scatter(shards)[1]
        mine.metrics, mine.samples = batch.metrics, batch.samples  # rank 0 logs the step's metrics
        return mine

    def push(self, step: int) -> dict[str, float]:
        if not sync_due(step, self.rollouts.config.rollout.vllm_sync_interval):
            return self.rollouts.push(step)  # {}: nothing to sync, nothing to agree on
        try:
            metrics = self.rollouts.push(step)
        except Exception as error:
            distributed.broadcast(f"adapter sync after step {step} failed on rank 0: {error}")
            raise
        distributed.broadcast(None)
        return metrics

    def evaluate(self, step: int):
        """Rank 0 evaluates; every rank gets its metrics (what eval.save_best decides on, on every rank, for
        the collective save), or its error."""
        try:
            evaluation = self.rollouts.evaluate(step)
        except Exception as error:
            distributed.broadcast(("error", f"rank 0 failed to evaluate after step {step}: {error}"))
            raise
        distributed.broadcast(("metrics", evaluation.metrics if evaluation is not None else None))
        return evaluation

    def state_dict(self) -> dict:
        return self.rollouts.state_dict()

    def close(self) -> None:
        self.rollouts.close()


class FollowerFeed:
    """Ranks 1..N-1: receive their shard, and join the collectives of every adapter sync."""

    def __init__(self, config: Config, policy: Policy) -> None:
        self.config, self.policy = config, policy
        self.probe = sync.make_verifier(config, policy)
        # Rank 0's Rollouts pushes the start version in its constructor: wait until it gets there, join
        # that sync's collectives, then learn its outcome.
        _raise_if(distributed.broadcast())
        self._sync_collectives()
        _raise_if(distributed.broadcast())

    def next_batch(self, step: int, abandon=lambda: False):
        kind, payload = distributed.scatter(None)
        while kind == "collective":  # rank 0's scoring needs the sharded model (on_all_ranks)
            work, work_payload = payload
            distributed.gather(_run_reporting(work, self.config, self.policy, work_payload))
            kind, payload = distributed.scatter(None)
        if kind == "error":
            raise RolloutError(payload)
        return payload if kind == "batch" else None

    def push(self, step: int) -> dict[str, float]:
        if sync_due(step, self.config.rollout.vllm_sync_interval):
            self._sync_collectives()
            _raise_if(distributed.broadcast())
        return {}

    def _sync_collectives(self) -> None:
        """What sync.push_adapter runs collectively on rank 0: the adapter gather, then the probe."""
        self.policy.save_trained(None)
        if self.probe is not None:
            sync.trainer_probe(self.policy, self.probe.probe_ids)

    def evaluate(self, step: int) -> Evaluation | None:
        """Rank 0's evaluation's metrics (its completions stay there)."""
        kind, payload = distributed.broadcast()
        if kind == "error":
            raise RolloutError(payload)
        return Evaluation(payload, [], None) if payload is not None else None

    def state_dict(self) -> None:
        return None

    def close(self) -> None:
        pass


def _raise_if(message: str | None) -> None:
    if message is not None:
        raise RolloutError(message)
