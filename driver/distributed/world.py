"""The training processes under torchrun (`torchrun --nproc-per-node N -m driver.train cfg.yaml`): who
we are, and the few collectives the driver itself issues.

Without torchrun (WORLD_SIZE unset or 1) nothing here starts a process group and every helper is the
identity, so the single-process path is unchanged. With it: gloo on CPU, NCCL for CUDA tensors and
gloo for Python objects on GPUs. Every collective here runs in the main thread, in the same order on
every rank: a collective from a background thread (the rollout prefetch thread) interleaves with the
main thread's differently on each rank and hangs (measured on gloo), so that thread only talks HTTP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from driver.metrics.combine import Metrics, combine_metrics

TIMEOUT = timedelta(minutes=30)  # a rank stuck this long in a collective fails instead of hanging forever


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_world = World()


def world() -> World:
    return _world


def init_world() -> World:
    """Join torchrun's process group (once); the single-process World without torchrun."""
    global _world
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 or dist.is_initialized():
        return _world
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)
    _world = World(rank, size, local_rank)
    return _world


def broadcast(value=None):
    """Rank 0's value on every rank (any picklable object)."""
    if not _world.distributed:
        return value
    box = [value if _world.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def scatter(values: list | None):
    """values[r] (given on rank 0) on rank r."""
    if not _world.distributed:
        return values[0]
    out = [None]
    dist.scatter_object_list(out, values if _world.is_main else None, src=0)
    return out[0]


def gather(value) -> list | None:
    """Every rank's value, in rank order, on rank 0 (None elsewhere); [value] in one process."""
    if not _world.distributed:
        return [value]
    out = [None] * _world.size if _world.is_main else None
    dist.gather_object(value, out, dst=0)
    return out


def max_int(value: int) -> int:
    """The largest value any rank holds."""
    if not _world.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)  # a CPU tensor: gloo, also beside NCCL
    return int(tensor)


def sum_floats(values: list[float]) -> list[float]:
    """Each value summed over the ranks."""
    if not _world.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)  # a CPU tensor: gloo, as max_int
    return tensor.tolist()


def reduce_metrics(metrics: Metrics, summed: tuple[str, ...] = ()) -> dict[str, float]:
    """The step's metric values from every rank's, each by its meaning (driver.metrics.combine.combine_metrics):
    the sum over ranks for `summed` keys, the min of */min (and *_min) keys and the max of */max (*_max),
    token means weighted by each rank's tokens (Metrics.counts), any other value the mean over the ranks
    that have it."""
    if not _world.distributed:
        return dict(metrics.values)
    gathered: list[Metrics | None] = [None] * _world.size
    dist.all_gather_object(gathered, metrics)
    return combine_metrics(gathered, summed).values


def barrier() -> None:
    if _world.distributed:
        dist.barrier()

