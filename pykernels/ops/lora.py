"""Fused LoRA linear: public function and fake (meta) implementations.

The compiled ops (csrc/torch_bindings.cpp) check their tensors and raise ValueError naming the bad
one; this layer flattens x, applies LoRA dropout and routes NF4 weights to the NF4 op. The ops'
autograd is registered in C++ (csrc/lora/lora_autograd.cpp: no Python between forward and backward,
which at small shapes cost more than the kernels); opcheck and torch.compile see it like any op's.
"""

from __future__ import annotations

import torch

from pykernels import backend
from pykernels._dtensor import full
from pykernels._extension import check_device, ops
from pykernels.nf4_weight import NF4Weight
from pykernels.ops.nf4 import dequantize
from pykernels.reference import lora as reference

_EMPTY_SHAPE = (0,)


# ---------------------------------------------------------------- fake implementations
def _forward_fake(x, lora_A, out_features):
    return x.new_empty((x.shape[0], out_features)), x.new_empty((x.shape[0], lora_A.shape[0]), dtype=torch.float32)


@torch.library.register_fake("pykernels::lora_linear")
def _lora_linear_fake(x, weight, lora_A, lora_B, scaling, bias=None, x_lora=None):
    torch._check(weight.shape[1] == x.shape[1], lambda: "weight must have shape (out_features, in_features)")
    return _forward_fake(x, lora_A, weight.shape[0])


@torch.library.register_fake("pykernels::lora_linear_nf4")
def _lora_linear_nf4_fake(x, packed, absmax, blocksize, out_features, lora_A, lora_B, scaling, bias=None,
                          x_lora=None, nested_absmax=None, nested_code=None, nested_offset=None, nested_blocksize=256):
    return _forward_fake(x, lora_A, out_features)


def _backward_fake(grad_y, x, lora_A, lora_B, x_lora, compute_grad_x):
    grad_x = x.new_empty(x.shape if compute_grad_x else _EMPTY_SHAPE)
    grad_x_lora = x.new_empty(x.shape if x_lora is not None else _EMPTY_SHAPE)
    return grad_x, grad_x_lora, torch.empty_like(lora_A), torch.empty_like(lora_B)


@torch.library.register_fake("pykernels::lora_linear_backward")
def _lora_linear_backward_fake(grad_y, x, weight, lora_A, lora_B, xa, scaling, x_lora=None, compute_grad_x=True):
    return _backward_fake(grad_y, x, lora_A, lora_B, x_lora, compute_grad_x)


@torch.library.register_fake("pykernels::lora_linear_nf4_backward")
def _lora_linear_nf4_backward_fake(grad_y, x, packed, absmax, blocksize, lora_A, lora_B, xa, scaling, x_lora=None,
                                   compute_grad_x=True, nested_absmax=None, nested_code=None, nested_offset=None,
                                   nested_blocksize=256):
    return _backward_fake(grad_y, x, lora_A, lora_B, x_lora, compute_grad_x)


# ---------------------------------------------------------------- public function
def lora_linear(x: torch.Tensor, weight: torch.Tensor | NF4Weight, lora_A: torch.Tensor, lora_B: torch.Tensor,
                scaling: float, bias: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """y = x W^T + bias + scaling * (dropout(x) A^T) B^T, with gradients for x, A, B and bias.

    Args:
        x: [..., in_features], fp32/fp16/bf16, any layout.
        weight: the frozen base weight, a Tensor [out_features, in_features] in x's dtype or an
            NF4Weight (dequantized a chunk at a time inside the op, never in full).
        lora_A: [r, in_features]; lora_B: [out_features, r]; float32 or x's dtype, any r >= 1.
        scaling: alpha / r (or alpha / sqrt(r) for rsLoRA).
        dropout: probability of LoRA-input dropout (apply it only in training); 0 adds no pass.

    Example:
        >>> y = pykernels.lora.lora_linear(x, layer.weight, A, B, scaling=2.0)
    """
    if dropout < 0 or dropout >= 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    # FSDP2 hands plain tensors to a module's forward; a DTensor here was read outside it: gathered.
    x, lora_A, lora_B, bias = full(x), full(lora_A), full(lora_B), full(bias)
    weight = full(weight) if isinstance(weight, torch.Tensor) else weight
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        raise ValueError("weight must be frozen (requires_grad=False): lora_linear computes no weight gradient")
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features).contiguous()
    x_lora = torch.nn.functional.dropout(flat, dropout) if dropout > 0 else None
    if backend.use_reference("lora"):
        dense = dequantize(weight, x.dtype) if isinstance(weight, NF4Weight) else weight
        y = reference.lora_linear(flat, dense, lora_A, lora_B, scaling, bias, x_lora)
    elif isinstance(weight, NF4Weight):
        check_device(weight.packed, "weight")
        absmax = weight.absmax_q if weight.double_quant else weight.absmax
        y, _ = ops.lora_linear_nf4(flat, weight.packed, absmax, weight.blocksize, weight.shape[0], lora_A, lora_B,
                                   float(scaling), bias, x_lora, weight.nested_absmax, weight.nested_code,
                                   weight.nested_offset, weight.nested_blocksize)
    else:
        check_device(x, "x")
        y, _ = ops.lora_linear(flat, weight, lora_A, lora_B, float(scaling), bias, x_lora)
    return y.reshape(*x.shape[:-1], y.shape[-1])
