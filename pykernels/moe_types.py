"""What the MoE ops take, shared by the ops (pykernels/moe.py, ops/moe.py, ops/moe_nf4.py), the
integrations and the pure-torch reference: LoRA factors on expert weights and the activation table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


@dataclass(frozen=True)
class LoRAFactors:
    """LoRA on one expert weight [E, out, in], PEFT layout: a [r * E, in], b [out, r * E]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def expert(self, e: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.a.shape[0] // num_experts
        return self.a[e * r:(e + 1) * r], self.b[:, e::num_experts]
