"""NF4 quantize / dequantize: public functions and fake (meta) implementations.

The compiled ops (schemas in csrc/torch_bindings.cpp) validate their tensor arguments and raise
ValueError naming the bad one; this layer adds what C++ cannot see (devices without kernels, the
NF4Weight container) and the register_fake functions torch.compile needs.
"""

from __future__ import annotations

import torch

from pykernels import backend
from pykernels._extension import check_device, ops
from pykernels.nf4_weight import NF4Weight
from pykernels.nf4_format import NESTED_BLOCKSIZE, dynamic_map
from pykernels.reference import nf4 as reference

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.register_fake("pykernels::nf4_quantize")
def _nf4_quantize_fake(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x must be float32, float16 or bfloat16, got {x.dtype}")
    torch._check(x.numel() > 0, lambda: "x must not be empty")
    numel = x.numel()
    packed = x.new_empty(((numel + 1) // 2,), dtype=torch.uint8)
    absmax = x.new_empty(((numel + blocksize - 1) // blocksize,), dtype=torch.float32)
    return packed, absmax


@torch.library.register_fake("pykernels::nf4_dequantize")
def _nf4_dequantize_fake(
    packed, absmax, blocksize, shape, dtype, nested_absmax=None, nested_code=None,
    nested_offset=None, nested_blocksize=NESTED_BLOCKSIZE,
) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel = numel * size
    torch._check(packed.numel() == (numel + 1) // 2, lambda: "packed must have ceil(numel / 2) elements")
    torch._check(absmax.numel() == (numel + blocksize - 1) // blocksize,
                 lambda: "absmax must have one element per block")
    return packed.new_empty(shape, dtype=dtype)


@torch.library.register_fake("pykernels::nf4_dequantize_into")
def _nf4_dequantize_into_fake(
    packed, absmax, blocksize, out, nested_absmax=None, nested_code=None, nested_offset=None,
    nested_blocksize=NESTED_BLOCKSIZE,
) -> None:
    torch._check(packed.numel() == (out.numel() + 1) // 2, lambda: "packed must have ceil(out.numel() / 2) elements")


@torch.library.register_fake("pykernels::dynamic8_quantize")
def _dynamic8_quantize_fake(x, code, blocksize, offset=None):
    numel = x.numel()
    q = x.new_empty((numel,), dtype=torch.uint8)
    absmax = x.new_empty(((numel + blocksize - 1) // blocksize,), dtype=torch.float32)
    return q, absmax


@torch.library.register_fake("pykernels::dynamic8_dequantize")
def _dynamic8_dequantize_fake(q, absmax, code, blocksize):
    return q.new_empty((q.numel(),), dtype=torch.float32)


# The 8-bit map for double quantization, built once; read-only (NF4Weights share it on CPU).
_DYNAMIC_CODE = dynamic_map()


def quantize(x: torch.Tensor, blocksize: int = 64, double_quant: bool = False) -> NF4Weight:
    """Quantize ``x`` to NF4, bit-exact with ``bitsandbytes.functional.quantize_4bit`` on CPU.

    Args:
        x: fp32, fp16 or bf16 tensor of any shape and numel (non-contiguous is fine: values are
            taken in row-major order, as bitsandbytes does).
        blocksize: values per absmax block, a power of two in [32, 4096].
        double_quant: also 8-bit quantize absmax (bitsandbytes' ``compress_statistics``), which
            saves 0.37 bits per value at blocksize 64.

    Example:
        >>> w = pykernels.nf4.quantize(torch.randn(4096, 4096, dtype=torch.bfloat16), double_quant=True)
        >>> pykernels.nf4.dequantize(w).shape
        torch.Size([4096, 4096])
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if backend.use_reference("nf4"):
        return _quantize_reference(x, blocksize, double_quant)
    check_device(x, "x")
    packed, absmax = ops.nf4_quantize(x.contiguous(), blocksize)
    if not double_quant:
        return NF4Weight(packed=packed, absmax=absmax, shape=x.shape, dtype=x.dtype, blocksize=blocksize)
    offset = absmax.mean()
    code = _DYNAMIC_CODE.to(x.device)
    absmax_q, nested_absmax = ops.dynamic8_quantize(absmax, code, NESTED_BLOCKSIZE, offset)
    return NF4Weight(
        packed=packed, shape=x.shape, dtype=x.dtype, blocksize=blocksize, absmax_q=absmax_q,
        nested_absmax=nested_absmax, nested_offset=offset, nested_code=code,
        nested_blocksize=NESTED_BLOCKSIZE,
    )


def dequantize(weight: NF4Weight, dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``weight`` approximates, in ``dtype`` (default: the original dtype, or ``out``'s).

    Bit-exact with ``bitsandbytes.functional.dequantize_4bit`` on CPU: each value is
    ``code[nibble] * absmax[block]`` in fp32, rounded once to ``dtype``. ``out``: a contiguous
    tensor of ``weight.shape`` on its device to write into and return, as bitsandbytes' ``out=``
    (a loop that dequantizes every step reuses one buffer instead of allocating).

    Example:
        >>> w = pykernels.nf4.quantize(torch.randn(64, 128), double_quant=True)
        >>> buffer = torch.empty(64, 128, dtype=torch.bfloat16)
        >>> pykernels.nf4.dequantize(w, out=buffer) is buffer
        True
    """
    if not isinstance(weight, NF4Weight):
        raise TypeError(f"weight must be an NF4Weight, got {type(weight).__name__}")
    check_device(weight.packed, "weight")
    if out is not None:
        dtype = _check_out(weight, dtype, out)
    dtype = weight.dtype if dtype is None else dtype
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if backend.use_reference("nf4"):
        result = _dequantize_reference(weight, dtype)
        return result if out is None else out.copy_(result)
    absmax = weight.absmax_q if weight.double_quant else weight.absmax
    nested = (weight.nested_absmax, weight.nested_code, weight.nested_offset, weight.nested_blocksize)
    if out is None:
        return ops.nf4_dequantize(weight.packed, absmax, weight.blocksize, list(weight.shape), dtype, *nested)
    ops.nf4_dequantize_into(weight.packed, absmax, weight.blocksize, out, *nested)
    return out


def _check_out(weight: NF4Weight, dtype: torch.dtype | None, out) -> torch.dtype:
    """out's dtype, once out is a tensor the dequantized weight can be written into."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out must have the weight's shape {tuple(weight.shape)}, got {tuple(out.shape)}")
    if dtype is not None and out.dtype != dtype:
        raise ValueError(f"out is {out.dtype} but dtype {dtype} was asked for: give one of them, or both alike")
    if out.device != weight.packed.device:
        raise ValueError(f"out must be on the weight's device {weight.packed.device}, got {out.device}")
    if out.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out must be float32, float16 or bfloat16, got {out.dtype}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.requires_grad:
        raise ValueError("out must not require grad: the dequantized weight is a constant")
    return out.dtype


def _quantize_reference(x: torch.Tensor, blocksize: int, double_quant: bool) -> NF4Weight:
    packed, absmax = reference.quantize_nf4(x, blocksize)
    if not double_quant:
        return NF4Weight(packed=packed, absmax=absmax, shape=x.shape, dtype=x.dtype, blocksize=blocksize)
    code = _DYNAMIC_CODE.to(x.device)
    absmax_q, nested_absmax, offset = reference.quantize_absmax(absmax, code)
    return NF4Weight(packed=packed, shape=x.shape, dtype=x.dtype, blocksize=blocksize, absmax_q=absmax_q,
                     nested_absmax=nested_absmax, nested_offset=offset, nested_code=code)


def _dequantize_reference(weight: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    absmax = weight.absmax
    if weight.double_quant:
        absmax = reference.dequantize_absmax(weight.absmax_q, weight.nested_absmax, weight.nested_offset,
                                             weight.nested_code, weight.nested_blocksize)
    return reference.dequantize_nf4(weight.packed, absmax, weight.blocksize, weight.shape, dtype)
