"""Fused LoRA linear (dense and QLoRA bases): y = x W^T + bias + scaling * (x A^T) B^T.

>>> import torch, pykernels.lora
>>> x, W = torch.randn(4, 64), torch.randn(32, 64)
>>> A, B = torch.randn(8, 64, requires_grad=True), torch.zeros(32, 8, requires_grad=True)
>>> pykernels.lora.lora_linear(x, W, A, B, scaling=2.0).shape
torch.Size([4, 32])
"""

from pykernels.ops.lora import lora_linear

__all__ = ["lora_linear"]
