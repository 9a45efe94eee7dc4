"""What the MoE ops take, shared by the ops (pykernels/moe.py, ops/moe.py, ops/moe_nf4.py), the
integrations and the pure-torch reference: LoRA factors on expert weights and the gated activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# act(gate) * up: the gated MLP of Qwen-MoE, Mixtral, DeepSeek, Ernie 4.5, Mistral 4 (silu), Gemma 4 (gelu_tanh).
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS' gated activation (transformers' GptOssExperts._apply_gate): the gate clamped to at
    most limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __str__(self) -> str:
        return f"clamped_swiglu(alpha={self.alpha:g},limit={self.limit:g})"


Activation = str | ClampedSwiGLU  # a name in ACTIVATIONS, "clamped_swiglu" (GPT-OSS' defaults) or a ClampedSwiGLU
ACTIVATION_NAMES = (*ACTIVATIONS, "clamped_swiglu")


def check_activation(act: Activation) -> None:
    if not isinstance(act, ClampedSwiGLU) and act not in ACTIVATION_NAMES:
        raise ValueError(f"act must be one of {sorted(ACTIVATION_NAMES)} or a ClampedSwiGLU, got {act!r}")


def gated_activation(gate_up: torch.Tensor, act: Activation, interleaved: bool = False) -> torch.Tensor:
    """The expert MLP's inner activation [..., I] from the gate_up projection [..., 2I]: gate and up
    are the first and last I columns (transformers' concatenated layout), or alternate column by
    column when interleaved (GPT-OSS: gate = columns 0, 2, ..., up = 1, 3, ...)."""
    gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if interleaved else gate_up.chunk(2, dim=-1)
    if act == "clamped_swiglu":
        act = ClampedSwiGLU()
    if isinstance(act, ClampedSwiGLU):
        return act(gate, up)
    return ACTIVATIONS[act](gate) * up


@dataclass(frozen=True)
class LoRAFactors:
    """LoRA on one expert weight [E, out, in], PEFT layout: a [r * E, in], b [out, r * E]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def expert(self, e: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.a.shape[0] // num_experts
        return self.a[e * r:(e + 1) * r], self.b[:, e::num_experts]
