"""bitsandbytes 0.50 as the NF4 oracle, with its one CPU defect routed around.

bitsandbytes' native CPU dequantize_4bit kernel indexes absmax per row: when the last dimension
is not a multiple of the blocksize it reads the wrong scale for all but the first row (e.g. shape
(7, 51, 64) with blocksize 128). Its own pure-torch implementation (backends/default) is correct,
so dequantization is checked against that everywhere and against the public API where the native
kernel is right.
"""

from __future__ import annotations

import bitsandbytes.functional as F
import torch
from bitsandbytes.backends.default import ops as bnb_default

# The default backend wraps this in torch.compile (one compile per shape); use the eager function.
_dequantize_4bit_eager = bnb_default._dequantize_4bit_compute.__wrapped__


def quantize(x: torch.Tensor, blocksize: int, double_quant: bool):
    """(packed bytes flat, QuantState) from bitsandbytes.functional.quantize_4bit."""
    packed, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4")
    return packed.reshape(-1), state


def absmax_fp32(state) -> torch.Tensor:
    """Per-block fp32 absmax, undoing double quantization as bitsandbytes does."""
    if not state.nested:
        return state.absmax
    return F.dequantize_blockwise(state.absmax, state.state2) + state.offset


def dequantize(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """bitsandbytes' pure-torch 4-bit dequantization (correct for every shape)."""
    dtype = dtype or state.dtype
    out = _dequantize_4bit_eager(packed.reshape(-1), absmax_fp32(state), state.code, state.blocksize,
                                 state.shape, dtype)
    return out.reshape(state.shape)


def native_dequantize_is_correct(shape: torch.Size, blocksize: int) -> bool:
    return len(shape) >= 1 and shape[-1] % blocksize == 0


def dequantize_public(packed_2d: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes.functional.dequantize_4bit (its native CPU kernel for most shapes)."""
    return F.dequantize_4bit(packed_2d, state).reshape(state.shape)
