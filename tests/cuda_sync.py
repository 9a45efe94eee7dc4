"""The CUDA tests' check that work queues without waiting for the GPU: inside `no_host_sync()` any
device-to-host synchronization raises (torch.cuda.set_sync_debug_mode("error")). Tests marked `cuda`
already run our kernels (tests/conftest.py): under `auto`, a first call times both sides, which
synchronizes."""

import contextlib

import torch


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
