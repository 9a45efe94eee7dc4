"""The update's peak-memory metric sees a temporary allocation that is gone by the time it is read."""

import torch

from driver import memory


def test_peak_covers_a_freed_temporary():
    device = torch.device("cpu")
    memory.reset_peak(device)
    baseline = memory.peak_gib(device)
    temporary = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del temporary
    peak = memory.peak_gib(device)
    assert baseline is not None and peak is not None
    assert peak - baseline >= 60 / 1024
