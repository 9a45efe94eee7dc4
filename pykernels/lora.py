"""Fused LoRA linear (dense and QLoRA bases): y = x W^T + bias + scaling * (x A^T) B^T.

>>> import torch, pykernels.lora
>>> x, W = torch.randn(4, 64), torch.randn(32, 64)
>>> A, B = torch.randn(8, 64, requires_grad=True), torch.zeros(32, 8, requires_grad=True)
>>> pykernels.lora.lora_linear(x, W, A, B, scaling=2.0).shape
torch.Size([4, 32])

Dispatched (pykernels/dispatch.py): ours, or F.linear + eager LoRA (pykernels.reference.lora).
"""

from pykernels import dispatch
from pykernels.nf4_weight import NF4Weight
from pykernels.ops import lora as _ops


def _bucket(x, weight, lora_A, lora_B, scaling, bias=None, dropout=0.0):
    base = "nf4" if isinstance(weight, NF4Weight) else "dense"
    tokens = dispatch.token_bucket(x.numel() // max(x.shape[-1], 1))
    return x.device, x.dtype, (f"tokens<={tokens} in={x.shape[-1]} out={weight.shape[0]} r={lora_A.shape[0]} "
                               f"{base}{' bias' if bias is not None else ''}")


lora_linear = dispatch.dispatched("lora", _ops.lora_linear, _bucket, probe={"dropout": 0.0})

__all__ = ["lora_linear"]
