"""NF4Linear: a linear layer whose frozen weight is stored in NF4 and dequantized on the fly.

Only the packed weight is kept between forward and backward: the backward pass dequantizes
again instead of saving the full-precision weight, so a QLoRA model's activation memory does
not grow by one bf16 copy of every layer. State-dict keys are those of bitsandbytes'
``Linear4bit``, so checkpoints load in either library.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pykernels.nf4_weight import NF4Weight
from pykernels.nf4 import dequantize, quantize

_WEIGHT_FIELDS = ("packed", "absmax", "absmax_q", "nested_absmax", "nested_offset", "nested_code")


class _NF4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight = weight
        ctx.has_bias = bias is not None
        return F.linear(x, _dense_weight(weight, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_output @ _dense_weight(ctx.weight, grad_output.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_x, None, grad_bias


def _dense_weight(weight: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    # Dequantize to the stored dtype first (what bitsandbytes' matmul_4bit does), so results do
    # not depend on the activation dtype beyond the final cast.
    dense = dequantize(weight)
    return dense if dense.dtype == dtype else dense.to(dtype)


def nf4_linear(x: torch.Tensor, weight: NF4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` with gradients for x and bias (weight is frozen)."""
    if len(weight.shape) != 2:
        raise ValueError(f"weight must be a 2-D NF4Weight (out_features, in_features), got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x must have in_features = {weight.shape[1]} as its last dimension, got shape {tuple(x.shape)}"
        )
    return _NF4LinearFunction.apply(x, weight, bias)


class NF4Linear(nn.Linear):
    """``nn.Linear`` with a frozen NF4 weight.

    Build one with :meth:`from_linear` (quantizes) or :meth:`from_bnb` (takes a bitsandbytes
    ``Linear4bit`` as is). The bias, if any, keeps its dtype and ``requires_grad``. It subclasses
    ``nn.Linear`` (as bitsandbytes' Linear4bit does) so PEFT and transformers treat it as a linear
    layer; ``weight`` is the NF4Weight, never a Parameter.

    Example:
        >>> layer = NF4Linear.from_linear(torch.nn.Linear(512, 256), double_quant=True)
        >>> layer(torch.randn(4, 512)).shape
        torch.Size([4, 256])
    """

    def __init__(self, weight: NF4Weight, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a dense weight
        if len(weight.shape) != 2:
            raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self._load_weight(weight)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int = 64, double_quant: bool = True) -> NF4Linear:
        weight = quantize(linear.weight.detach(), blocksize=blocksize, double_quant=double_quant)
        return cls(weight, linear.bias)

    @classmethod
    def from_bnb(cls, linear4bit: nn.Module) -> NF4Linear:
        """From a bitsandbytes ``Linear4bit`` (NF4), sharing its quantized data."""
        return cls(NF4Weight.from_bnb_params(linear4bit.weight), linear4bit.bias)

    @property
    def weight(self) -> NF4Weight:
        tensors = {name: getattr(self, f"weight_{name}") for name in _WEIGHT_FIELDS}
        tensors = {name: t for name, t in tensors.items() if t is not None}
        return NF4Weight(**tensors, **self._weight_meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        meta = self._weight_meta
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, blocksize={meta['blocksize']}, "
                f"double_quant={self.weight_absmax_q is not None}, dtype={meta['dtype']}")

    def _load_weight(self, weight: NF4Weight) -> None:
        for name in _WEIGHT_FIELDS:
            # Not persistent: the state dict carries bitsandbytes' keys instead (see below).
            self.register_buffer(f"weight_{name}", getattr(weight, name), persistent=False)
        self._weight_meta = dict(shape=weight.shape, dtype=weight.dtype, blocksize=weight.blocksize,
                                 nested_blocksize=weight.nested_blocksize)

    def _apply(self, fn, recurse=True):
        # .to(device) moves the quantized tensors; a dtype cast (.half(), .to(bf16)) must not touch
        # them: rounding absmax would change every dequantized value.
        quantized = {name: self._buffers.pop(f"weight_{name}") for name in _WEIGHT_FIELDS}
        super()._apply(fn, recurse)
        device = fn(torch.empty(0, device=quantized["packed"].device)).device
        for name, tensor in quantized.items():
            self._buffers[f"weight_{name}"] = None if tensor is None else tensor.to(device)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, tensor in self.weight.to_bnb_state_dict(prefix + "weight").items():
            destination[key] = tensor if keep_vars else tensor.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        weight_key = prefix + "weight"
        ours = [k for k in state_dict if k == weight_key or k.startswith(weight_key + ".")]
        if weight_key in state_dict:
            try:
                weight = NF4Weight.from_bnb_state_dict(state_dict, weight_key)
            except (KeyError, ValueError) as error:
                error_msgs.append(f"{weight_key}: {error}")
            else:
                if weight.shape != (self.out_features, self.in_features):
                    error_msgs.append(f"{weight_key}: checkpoint shape {tuple(weight.shape)} does not "
                                      f"match ({self.out_features}, {self.in_features})")
                else:
                    self._load_weight(weight.to(self.weight_packed.device))
        elif strict:
            missing_keys.append(weight_key)
        remaining = {k: v for k, v in state_dict.items() if k not in ours}
        super()._load_from_state_dict(remaining, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
