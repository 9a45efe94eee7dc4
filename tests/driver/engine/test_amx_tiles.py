"""A launched vLLM server's worker may use AMX tiles: importing the worker extension (vLLM does, in each worker
process) asks Linux for the tile state, which vLLM's CPU bf16 attention uses without asking (its worker died of
SIGILL on the first request: tests/e2e's QLoRA server run on an Intel CI machine). Asked of the kernel itself
(arch_prctl ARCH_GET_XCOMP_PERM) in a fresh process, where torch has not asked yet."""

import platform
import subprocess
import sys

import pytest
import torch

PROBE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)

def tile_permitted():
    mask = ctypes.c_ulong(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()  # arch_prctl, GET_XCOMP_PERM
    return bool(mask.value & (1 << 18))  # XFEATURE_XTILEDATA

import torch
before = tile_permitted()
import driver.engine.server_worker
print(before, tile_permitted(), driver.engine.server_worker.allow_amx_tiles())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64"
                    or not torch.cpu._is_amx_tile_supported(), reason="needs a Linux x86 CPU with AMX")
def test_importing_the_worker_extension_allows_amx_tiles():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True", "True"]


def test_without_amx_nothing_is_asked(monkeypatch):
    from driver.engine import server_worker

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: pytest.fail("asked for AMX on a CPU without it"))
    assert server_worker.allow_amx_tiles() is False
