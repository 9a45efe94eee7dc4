"""The update's peak-memory metric sees a temporary that is gone by the time it is read."""

import mmap

import torch

from driver.metrics import memory


def test_peak_covers_a_freed_temporary():
    device = torch.device("cpu")
    memory.reset_peak(device)
    baseline = memory.peak_gib(device)
    size = 64 * 2**20
    temporary = mmap.mmap(-1, size)  # fresh pages (an allocator could hand back resident ones)
    for offset in range(0, size, mmap.PAGESIZE):
        temporary[offset] = 1
    temporary.close()
    peak = memory.peak_gib(device)
    assert baseline is not None and peak is not None
    assert peak - baseline >= 60 / 1024
