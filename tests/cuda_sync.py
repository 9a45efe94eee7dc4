"""The CUDA tests' check that work queues without waiting for the GPU: inside `no_host_sync()` any
device-to-host synchronization raises (torch.cuda.set_sync_debug_mode("error")), with our kernels
forced (`auto` times both sides on a first call, which synchronizes) and the previous modes restored."""

import contextlib

import torch

from pykernels import backend


@contextlib.contextmanager
def no_host_sync():
    with backend.kernels_mode("ours"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
