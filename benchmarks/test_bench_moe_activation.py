"""The expert MLP's gated activation between the two grouped GEMMs: ours (pykernels.moe.gated_activation,
one pass each way, csrc/moe/gated_act.h) vs torch eager's silu(gate) * up (transformers' experts
code: 2 kernels forward with an [rows, I] temporary, ~6 backward), forward+backward in bf16 on the
[T*k, 2I] rows of benchmarks/test_bench_moe.py's cases. Memory-bound: GB/s counts the fused op's
traffic for both (read 2I, write I forward; read 2I and I, write 2I backward: 8I elements a row).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.conftest import AVX512_CPU_CLASSES, NARROW_CPU_CLASSES, read_by_a_rule, run_device_class
from benchmarks.test_bench_moe import SHAPES
from pykernels import moe, moe_types


def cases(device_class: str) -> list[tuple[str, int]]:  # (shape, tokens), the experts benchmarks' own
    if device_class in AVX512_CPU_CLASSES + NARROW_CPU_CLASSES:
        return [("qwen3-30b-a3b", 512), ("mixtral-i3584", 512)]
    return [("qwen3-30b-a3b", 16384), ("mixtral", 4096)]


def params() -> list:
    device_class = run_device_class()
    return [pytest.param(impl, shape, tokens, id=f"{shape}-T{tokens}-{impl}")
            for shape, tokens in cases(device_class) for impl in ("ours", "eager")
            if read_by_a_rule("moe", "gated_activation", impl, device_class)]


@pytest.mark.parametrize(("impl", "shape", "tokens"), params())
def test_gated_activation(measure, device, impl, shape, tokens):
    _, inter, _, top_k = SHAPES[shape]
    rows = tokens * top_k
    gen = torch.Generator(device=device.torch_device).manual_seed(0)
    gate_up = torch.randn(rows, 2 * inter, device=device.torch_device, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(rows, inter, device=device.torch_device, generator=gen).bfloat16()
    activation = moe.gated_activation if impl == "ours" else moe_types.gated_activation

    def call():
        gate_up.grad = None
        activation(gate_up, "silu").backward(grad)

    measure(call, bytes_moved=8 * rows * inter * 2, family="moe", op="gated_activation", case=f"{shape}-T{tokens}",
            impl=impl)
