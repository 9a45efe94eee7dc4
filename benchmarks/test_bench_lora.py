"""Fused LoRA linear: ours vs PEFT vs the base matmul alone, forward and forward+backward.

Shapes are Llama-3-8B-like projections (4096x4096, 4096x14336) and a Qwen3-30B-A3B expert-sized one
(2048x768), bf16, LoRA on a frozen base (dense bf16, or NF4 with double quantization: ours vs PEFT
over bitsandbytes' Linear4bit, the usual QLoRA stack). extra_info["overhead_pct"] is the time over
the base matmul alone. GPUs run T in {1024, 8192} and r in {8, 16, 64}; the 2-core AVX-512 CPU runs
T=1024 and r=16 (plus r in {8, 64} on 4096x4096) so the suite stays within minutes; a CPU without
AVX-512 ("cpu-scalar", "cpu-avx2": ours multiplies fp32 copies, torch's bf16 GEMMs have no vector path and
PEFT's forward+backward takes 30 s at 4096x4096, T=256) runs 2048x768 at T=256 and 4096x4096 at
T=32, r=16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pykernels.lora as lora
import pykernels.nf4 as nf4
from benchmarks.conftest import AVX512_CPU_CLASSES, NARROW_CPU_CLASSES, read_by_a_rule, run_device_class

SHAPES = {"4096x4096": (4096, 4096), "4096x14336": (4096, 14336), "2048x768": (2048, 768)}  # (in, out)


def cases(device_class: str) -> list[tuple[str, int, int]]:
    if device_class in AVX512_CPU_CLASSES:
        return [(name, 1024, 16) for name in SHAPES] + [("4096x4096", 1024, r) for r in (8, 64)]
    if device_class in NARROW_CPU_CLASSES:
        return [("4096x4096", 32, 16), ("2048x768", 256, 16)]
    return [(name, tokens, r) for name in SHAPES for tokens in (1024, 8192) for r in (8, 16, 64)]


class Layer:
    """One frozen base + LoRA adapter, callable three ways on the same tensors."""

    def __init__(self, in_features: int, out_features: int, r: int, base: str, device: torch.device):
        torch.manual_seed(0)
        dtype = torch.bfloat16
        self.dense = (torch.randn(out_features, in_features, device=device) / in_features ** 0.5).to(dtype)
        self.a = nn.Parameter(torch.randn(r, in_features, device=device) / in_features ** 0.5)
        self.b = nn.Parameter(torch.randn(out_features, r, device=device) * 0.01)
        self.scaling = 2.0
        self.weight = nf4.quantize(self.dense, 64, double_quant=True) if base == "nf4" else self.dense
        self.peft = self._peft_layer(in_features, out_features, r, base, device)

    def _peft_layer(self, in_features, out_features, r, base, device):
        from peft import LoraConfig, get_peft_model

        holder = nn.Sequential()
        if base == "nf4":
            import bitsandbytes as bnb

            layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16,
                                      compress_statistics=True, quant_type="nf4")
            layer.weight = bnb.nn.Params4bit(self.dense.cpu(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
            layer = layer.to(device)
        else:
            layer = nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
            layer.weight.data.copy_(self.dense)
        holder.add_module("proj", layer)
        model = get_peft_model(holder, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"]))
        lora_layer = model.base_model.model.proj
        lora_layer.lora_A["default"].weight.data.copy_(self.a.data)
        lora_layer.lora_B["default"].weight.data.copy_(self.b.data)
        return model.train()

    def ours(self, x):
        return lora.lora_linear(x, self.weight, self.a, self.b, self.scaling)

    def base_only(self, x):
        return torch.nn.functional.linear(x, self.dense)


def run(fn, x, backward: bool):
    if not backward:
        with torch.no_grad():
            return fn(x)
    y = fn(x)
    y.backward(torch.ones_like(y))
    return y


@pytest.fixture(scope="module")
def layers():
    return {}


def params() -> list:
    """(impl, case, base, mode) in the order the layers are built; the base matmul is timed once, with
    the bf16 base (the same dense GEMM for both); on a rules-only class, the runs a rule reads."""
    device_class = run_device_class()
    runs = [(impl, case, base, mode) for base in ("bf16", "nf4") for case in cases(device_class)
            for mode in ("forward", "forward_backward") for impl in ("ours", "peft", "base_matmul")
            if not (impl == "base_matmul" and base == "nf4")
            and read_by_a_rule("lora", f"{mode}_{base}", impl, device_class)]
    return [pytest.param(impl, case, base, mode, id=f"{impl}-{case[0]}-T{case[1]}-r{case[2]}-{base}-{mode}")
            for impl, case, base, mode in runs]


@pytest.mark.parametrize(("impl", "case", "base", "mode"), params())
def test_lora(measure, device, layers, impl, case, base, mode):
    name, tokens, r = case
    in_features, out_features = SHAPES[name]
    key = (name, r, base)
    if key not in layers:
        layers.clear()  # one layer alive at a time: the large ones are hundreds of MB
        layers[key] = Layer(in_features, out_features, r, base, device.torch_device)
    layer = layers[key]
    fn = {"ours": layer.ours, "peft": layer.peft, "base_matmul": layer.base_only}[impl]
    x = torch.randn(tokens, in_features, device=device.torch_device, dtype=torch.bfloat16,
                    requires_grad=mode == "forward_backward")
    # TFLOP/s counts the base GEMMs only (x W^T, and dy W backward): the useful work LoRA rides on.
    flops = 2 * tokens * in_features * out_features * (1 if mode == "forward" else 2)
    measure(lambda: run(fn, x, mode == "forward_backward"), flops=flops,
            family="lora", op=f"{mode}_{base}", case=f"{name}-T{tokens}-r{r}", impl=impl)
