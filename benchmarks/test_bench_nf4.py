"""NF4 quantize/dequantize: ours vs bitsandbytes vs the pure-torch reference.

Shapes come from real models: a 4096x4096 attention projection, a 4096x14336 MLP projection
(Llama-3-8B / Mistral-7B) and the stacked down_proj experts of Qwen3-30B-A3B (128 experts of
2048x768; 32 experts on CPU so one case stays within seconds; 8, and no 4096x14336, on a CPU
without AVX-512). Inputs are bf16, blocksize 64 with double quantization: what QLoRA uses.
The dequantize is timed as a loop would run it: ours writes into one output allocated before
timing (`out=`), and so does bitsandbytes on a GPU; its CPU op has no out variant (0.50 registers
`dequantize_4bit.out` for CUDA only), so there it allocates, as its users' calls do. A fresh output
on a CPU is timed with its page faults, which on a VM whose balloon reports free memory to the host
swing several-fold: the 2 MiB pages ours asks for (MADV_HUGEPAGE) come from blocks the host took
back, so after other work a call ran at a ninth of its speed (4096x14336, AMX: 198 ms against its
usual 22: 0.24x bitsandbytes, under the 1.0x floor). On a GPU the dequantize also runs beside `copy`, a
device copy moving the same bytes (half read, half written): the bandwidth ceiling issue 20's
">= 85% of copy bandwidth" is measured against.
"""

from __future__ import annotations

import pytest
import torch

import pykernels.nf4 as nf4
from benchmarks.conftest import AVX512_CPU_CLASSES, NARROW_CPU_CLASSES, run_device_class
from pykernels.reference import nf4 as reference

try:
    import bitsandbytes.functional as bnb_functional
except ImportError:  # the GPU image may lack it: those cases skip, and the gate reports them missing
    bnb_functional = None

BLOCKSIZE = 64
SHAPES = {
    "4096x4096": (4096, 4096),
    "4096x14336": (4096, 14336),
    "experts-Ex2048x768": (128, 2048, 768),
}
CPU_SHAPES = {**SHAPES, "experts-Ex2048x768": (32, 2048, 768)}
# Without AVX-512 (NARROW_CPU_CLASSES) bitsandbytes and the reference are slow: the two smaller shapes.
NARROW_CPU_SHAPES = {"4096x4096": (4096, 4096), "experts-Ex2048x768": (8, 2048, 768)}
IMPLS = ["ours", "bitsandbytes", "torch_reference"]


def shapes(device_class: str) -> dict[str, tuple[int, ...]]:
    if device_class in AVX512_CPU_CLASSES:
        return CPU_SHAPES
    return NARROW_CPU_SHAPES if device_class in NARROW_CPU_CLASSES else SHAPES


def quantize_fn(impl: str, x: torch.Tensor):
    if impl == "ours":
        return lambda: nf4.quantize(x, BLOCKSIZE, double_quant=True)
    if impl == "bitsandbytes":
        return lambda: bnb_functional.quantize_4bit(x, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")

    def torch_reference():
        packed, absmax = reference.quantize_nf4(x, BLOCKSIZE)
        return packed, reference.quantize_absmax(absmax, code)

    code = reference.dynamic_map(x.device)
    return torch_reference


def dequantize_fn(impl: str, x: torch.Tensor):
    out = torch.zeros_like(x)  # written here, so its pages are in before any timed call
    if impl == "ours":
        weight = nf4.quantize(x, BLOCKSIZE, double_quant=True)
        return lambda: nf4.dequantize(weight, out=out)
    if impl == "bitsandbytes":
        packed, state = bnb_functional.quantize_4bit(x, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")
        if not x.is_cuda:
            return lambda: bnb_functional.dequantize_4bit(packed, state)
        return lambda: bnb_functional.dequantize_4bit(packed, state, out=out)
    # The reference has no out: it allocates its intermediates (and output) whatever it is given.
    weight = nf4.quantize(x, BLOCKSIZE, double_quant=True)
    code = weight.nested_code

    def torch_reference():
        absmax = reference.dequantize_absmax(weight.absmax_q, weight.nested_absmax, weight.nested_offset, code)
        return reference.dequantize_nf4(weight.packed, absmax, BLOCKSIZE, weight.shape, weight.dtype)

    return torch_reference


def copy_fn(x: torch.Tensor):
    """A device copy of as many bytes as the dequantize reads and writes together (codes and scales
    in, bf16 out): its time over ours is our share of the copy bandwidth."""
    moved = x.numel() * 2 + packed_bytes(x.numel())
    source = torch.empty(moved // 2, dtype=torch.uint8, device=x.device)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def packed_bytes(numel: int) -> int:
    blocks = -(-numel // BLOCKSIZE)
    return (numel + 1) // 2 + blocks + 4 * (-(-blocks // 256))  # codes + absmax_q + nested absmax


OPS = {"quantize": quantize_fn, "dequantize": dequantize_fn}


def params() -> list:
    """(op, case, impl); `copy` beside the dequantize on GPUs only (on a CPU a memcpy into fresh pages
    times page faults, and no CPU rule reads it)."""
    device_class = run_device_class()
    gpu = not device_class.startswith("cpu")
    runs = [(op, case, impl) for op in OPS for case in shapes(device_class)
            for impl in IMPLS + (["copy"] if gpu and op == "dequantize" else [])]
    return [pytest.param(*run, id="-".join(run)) for run in runs]


@pytest.mark.parametrize(("op", "case", "impl"), params())
def test_nf4(measure, device, op, case, impl):
    if impl == "bitsandbytes" and bnb_functional is None:
        pytest.skip("bitsandbytes is not installed")
    x = torch.randn(shapes(device.device_class)[case], dtype=torch.bfloat16, device=device.torch_device)
    # Either way one side is the bf16 tensor and the other the packed form: the bytes are the same.
    fn = copy_fn(x) if impl == "copy" else OPS[op](impl, x)
    measure(fn, x.numel() * 2 + packed_bytes(x.numel()),
            family="nf4", op=op, case=case, impl=impl, shape="x".join(map(str, x.shape)))
