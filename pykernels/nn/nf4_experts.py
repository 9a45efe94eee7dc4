"""NF4ExpertWeight: a frozen 3-D MoE expert weight [E, out, in] stored in NF4, in place of an
experts module's gate_up_proj / down_proj Parameter (pykernels.integrations.transformers
.quantize_moe_experts). pykernels.moe.experts_forward dequantizes only the experts that received
tokens, in the forward and again in the backward, so a QLoRA MoE model never holds its experts in
16 bits. The quantized tensors are buffers: .to(device) moves them, dtype casts leave them alone.
"""

from __future__ import annotations

import torch
from torch import nn

from pykernels.nf4_weight import NF4Weight
from pykernels.ops.nf4 import quantize

_FIELDS = ("packed", "absmax", "absmax_q", "nested_absmax", "nested_offset", "nested_code")


class NF4ExpertWeight(nn.Module):
    """Example (Qwen3-30B-A3B's experts: E 128, I 768, H 2048):
        >>> w = NF4ExpertWeight.from_tensor(experts.gate_up_proj)   # [E, 2I, H] bf16 -> NF4
        >>> w.weight.dequantize().shape
        torch.Size([128, 1536, 2048])
    """

    def __init__(self, weight: NF4Weight) -> None:
        super().__init__()
        if len(weight.shape) != 3:
            raise ValueError(f"an expert weight must be [E, out, in], got shape {tuple(weight.shape)}")
        for name in _FIELDS:
            self.register_buffer(name, getattr(weight, name))
        self._meta = dict(shape=weight.shape, dtype=weight.dtype, blocksize=weight.blocksize,
                          nested_blocksize=weight.nested_blocksize)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> NF4ExpertWeight:
        return cls(quantize(tensor.detach(), blocksize=blocksize, double_quant=double_quant))

    @property
    def weight(self) -> NF4Weight:
        tensors = {name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None}
        return NF4Weight(**tensors, **self._meta)

    @property
    def shape(self) -> torch.Size:
        return self._meta["shape"]

    @property
    def dtype(self) -> torch.dtype:
        return self._meta["dtype"]

    def forward(self, *args, **kwargs):
        raise RuntimeError("NF4ExpertWeight is a weight, not a layer: the experts module's forward must run on "
                           "pykernels' kernels (pykernels.integrations.transformers.apply_moe_kernels)")

    def extra_repr(self) -> str:
        return (f"shape={tuple(self.shape)}, blocksize={self._meta['blocksize']}, "
                f"double_quant={self.absmax_q is not None}, dtype={self.dtype}")

    def _apply(self, fn, recurse=True):
        # .to(device) moves the quantized tensors; a dtype cast (.half(), .to(bf16)) must not touch
        # them: rounding absmax would change every dequantized value (as NF4Linear).
        device = fn(torch.empty(0, device=self.packed.device)).device
        for name in _FIELDS:
            if self._buffers.get(name) is not None:
                self._buffers[name] = self._buffers[name].to(device)
        return self
