"""Grouped MoE experts: ours (the "pykernels" experts implementation, pykernels.moe) vs transformers'
"eager" experts loop and its "grouped_mm" implementation (torch's grouped GEMM), forward and
forward+backward, with and without LoRA r=16 on the experts (PEFT target_parameters, as users run
it: PEFT hands the baselines W + B A per expert, built densely every forward).

The module is transformers' own Qwen3MoeExperts at the case's shapes, bf16, random weights and
routing (top-k of random logits, softmax weights). forward+backward is the RL setting: frozen
expert weights, gradients to the hidden states, the routing weights and the LoRA factors.
TFLOP/s counts 6 T k H I (forward) and 12 T k H I (forward+backward: dx only, the weights are
frozen), LoRA not counted. transformers' batched_mm gathers one [2I, H] weight per token-expert
pair (25 GB at Qwen3-30B-A3B shapes and T=512) and is left out where that exceeds 2 GB.
CPU: T=512 at Qwen3-30B-A3B shapes and at Mixtral's with I scaled 14336 -> 3584 (2-core budget).
A CPU without AVX-512 ("cpu-scalar", "cpu-avx2": torch's bf16 GEMMs have no vector path, and with LoRA the
baselines took 30-110 s a call at T=32) runs T=32 at Qwen3-30B-A3B shapes without LoRA;
GPUs: T in {512, 4096, 16384} at Qwen3-30B-A3B shapes, {512, 4096} at Mixtral's.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from benchmarks.conftest import AVX512_CPU_CLASSES, NARROW_CPU_CLASSES, read_by_a_rule, run_device_class
from pykernels.integrations.transformers import apply_moe_kernels

LORA_RANK = 16
# name: (hidden H, expert intermediate I, experts E, top-k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2),
          "mixtral-i3584": (4096, 3584, 8, 2)}


def cases(device_class: str) -> list[tuple[str, int]]:  # (shape, tokens)
    if device_class in AVX512_CPU_CLASSES:
        return [("qwen3-30b-a3b", 512), ("mixtral-i3584", 512)]
    if device_class in NARROW_CPU_CLASSES:
        return [("qwen3-30b-a3b", 32)]
    return [("qwen3-30b-a3b", t) for t in (512, 4096, 16384)] + [("mixtral", t) for t in (512, 4096)]


def impls(shape: str, tokens: int, mode: str, lora: bool, device_class: str) -> list[str]:
    hidden, inter, _, top_k = SHAPES[shape]
    batched_bytes = tokens * top_k * 2 * inter * hidden * 2
    # eager + PEFT forward+backward with LoRA on the experts takes 75 s a call on the CPU at Qwen3
    # shapes (PEFT's dense B A for 128 experts, twice, and its backward; measured once in
    # results/cpu.md), ~6 s at Mixtral's 8 experts: only the latter is in the suite.
    slow_eager = device_class in AVX512_CPU_CLASSES and lora and mode == "forward_backward" and shape == "qwen3-30b-a3b"
    batched = batched_bytes <= 2**31 and device_class not in NARROW_CPU_CLASSES  # 4.8 s a call there at T=32
    return ["ours"] + ([] if slow_eager else ["eager"]) + ["grouped_mm"] + (["batched_mm"] if batched else [])


def params() -> list:
    device_class = run_device_class()
    loras = (False,) if device_class in NARROW_CPU_CLASSES else (False, True)
    runs = [(impl, shape, tokens, mode, lora) for shape, tokens in cases(device_class)
            for mode in ("forward", "forward_backward") for lora in loras
            for impl in impls(shape, tokens, mode, lora, device_class)
            if read_by_a_rule("moe", f"{mode}_{'lora' if lora else 'base'}", impl, device_class)]
    return [pytest.param(*run, id=f"{run[3]}-{run[1]}-T{run[2]}-{'lora' if run[4] else 'base'}-{run[0]}")
            for run in runs]


class Block(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.experts = experts


def make_block(shape: str, lora: bool, device: torch.device) -> tuple[torch.nn.Module, transformers.PretrainedConfig]:
    hidden, inter, num_experts, top_k = SHAPES[shape]
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=num_experts,
                                         num_experts_per_tok=top_k, hidden_act="silu")
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    experts.requires_grad_(False)
    block = Block(experts)
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        block = inject_adapter_in_model(LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                   target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
                                        block)
        block.to(device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, param in block.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.01)
    apply_moe_kernels(block)  # registers "pykernels"; the test picks the implementation per run
    return block, config


def routed_tokens(shape: str, tokens: int, device: torch.device, requires_grad: bool):
    """(x [T, H] bf16, top_k_index, top_k_weights bf16) for an experts call: random hidden states and
    the top-k of random router logits with softmax weights, seeded."""
    hidden, _, num_experts, top_k = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    logits = torch.randn(tokens, num_experts, device=device, generator=gen)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    return x.requires_grad_(requires_grad), index, weights.bfloat16().requires_grad_(requires_grad)


@pytest.fixture(scope="module")
def blocks():
    return {}


@pytest.mark.parametrize(("impl", "shape", "tokens", "mode", "lora"), params())
def test_moe_experts(measure, device, blocks, impl, shape, tokens, mode, lora):
    key = (shape, lora)
    if key not in blocks:
        blocks.clear()  # one block alive at a time: up to ~0.8 GB of bf16 experts
        blocks[key] = make_block(shape, lora, device.torch_device)
    block, config = blocks[key]
    config._experts_implementation = "pykernels" if impl == "ours" else impl
    hidden, inter, _, top_k = SHAPES[shape]
    backward = mode == "forward_backward"
    x, index, weights = routed_tokens(shape, tokens, device.torch_device, requires_grad=backward)

    def call():
        x.grad = weights.grad = None
        if not backward:
            with torch.no_grad():
                return block.experts(x, index, weights)
        out = block.experts(x, index, weights)
        out.float().square().mean().backward()
        return out

    flops = (12 if backward else 6) * tokens * top_k * hidden * inter
    measure(call, flops=flops, family="moe", op=f"{mode}_{'lora' if lora else 'base'}", case=f"{shape}-T{tokens}",
            impl=impl)
