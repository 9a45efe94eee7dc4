"""Pure-torch LoRA linear (Hu et al. 2021, https://arxiv.org/abs/2106.09685): the readable math,
the test oracle and the fallback of pykernels.lora.

    y = x W^T + bias + scaling * (dropout(x) A^T) B^T

with the rank-r product x A^T computed and kept in fp32 (a 16-bit intermediate loses the small
LoRA updates; vllm#2893), and the sum rounded to x's dtype once.
"""

from __future__ import annotations

import torch


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor,
                scaling: float, bias: torch.Tensor | None = None, x_lora: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K] (dense, x's dtype), lora_A [r, K], lora_B [N, r]."""
    x_lora = x if x_lora is None else x_lora
    base = torch.nn.functional.linear(x, weight).float()
    low_rank = (x_lora.float() @ lora_A.float().T) @ lora_B.float().T
    y = base + scaling * low_rank
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
