"""Rank r's share of a step's rollout batch under torchrun, trained so that the sum of the ranks'
updates is the single-process update of the whole batch.

Rank 0 generates and scores the whole step (the same requests, seeds, rewards and advantages as a
single process: advantages are computed on whole groups before any split), then every rank trains
its shard. The shard is a batch like one zero-advantage filtering produces (driver/rollouts/filtering.py):
its StepCounts describe the whole step, so every loss type divides by the step's sequences, tokens
and micro-batches whatever rows this rank holds. Whole original micro-batches go round-robin to the
ranks (micro-batch k to rank k % world), which keeps bnpo's per-micro-batch token means intact; the
other loss types re-pack a rank's rows into micro-batches of micro_batch_size, which changes nothing
in their sums. A rank may get one micro-batch fewer than another: the update pads it with a
zero-loss pass (FSDP needs the same forwards and backwards on every rank).
"""

from __future__ import annotations

from dataclasses import replace


from driver.rollouts.batch import RolloutBatch
from driver.rollouts.filtering import step_counts


def shard_batch(batch: RolloutBatch, rank: int, world_size: int, micro_batch_size: int) -> RolloutBatch:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size = {world_size}), got {rank}")
    counts = batch.counts if batch.counts is not None else step_counts(batch, micro_batch_size)
    starts = [0]
    for rows in counts.micro_batch_rows:
        starts.append(starts[-1] + rows)
    mine = [k for k in range(len(counts.micro_batch_rows)) if k % world_size == rank]
    rows = [row for k in mine for row in range(starts[k], starts[k + 1])]
    shard = batch.select(rows, replace(counts, micro_batch_rows=[rows_k if k % world_size == rank else 0
                                                                 for k, rows_k in enumerate(counts.micro_batch_rows)]))
    return replace(shard, samples=[])  # the samples shown are rank 0's whole batch's
