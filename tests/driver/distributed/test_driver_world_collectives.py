"""driver.distributed.world's small collectives with two real gloo processes (what torchrun starts, less the
training): sum_floats (algo.use_adaptive_entropy's entropy of an update over every rank), max_int (the
micro-batch count every rank pads to) and broadcast. Oracle: the values each rank put in, combined here."""

import os
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from driver.distributed import world

    world.init_world()
    try:
        results[rank] = (world.sum_floats([0.25 + rank, 3.0 * rank, -1.0]), world.max_int(7 * rank - 2),
                         world.broadcast({"from": rank}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_floats_take_the_max_int_and_broadcast_from_rank_0():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        summed, largest, broadcast = results[rank]
        assert summed == [0.25 + 1.25, 3.0, -2.0]
        assert largest == 5
        assert broadcast == {"from": 0}
