"""Pure-torch NF4 (QLoRA 4-bit NormalFloat) quantization, bitsandbytes-compatible.

This module is the readable statement of the math, the test oracle for our kernels and the
fallback when the extension is missing. It reproduces bitsandbytes 0.50 on CPU bit for bit,
including its quirks (each is named where it happens):

* NF4 blocks (``bitsandbytes.functional.quantize_4bit``): absmax per block of the fp32 input,
  values scaled by ``x * (1 / absmax)`` and clamped to [-1, 1], code = number of NF4 midpoints
  that are not >= the value (``torch.bucketize``: ties go to the lower code, NaN to 15), two
  codes per byte, high nibble first, an odd tail padded with code 7 (0.0).
* Double quantization of absmax (``compress_statistics=True``): offset = mean(absmax), then
  ``absmax - offset`` is 8-bit quantized in blocks of 256 with the signed dynamic map through
  bitsandbytes' CPU kernel, which looks codes up in a 65536-entry table rather than searching
  the map (so it is not always the nearest code; we reproduce the table).

QLoRA: https://arxiv.org/abs/2305.14314. 8-bit dynamic map: https://arxiv.org/abs/1511.04561.
"""

from __future__ import annotations

import math

import torch

from pykernels.nf4_format import (  # noqa: F401 (the format, re-exported for the reference's readers)
    BLOCKSIZES, NESTED_BLOCKSIZE, NF4_CODE_VALUES, PAD_CODE, dynamic_map, nf4_code, num_blocks)

# torch clamps absmax with min=1e-38 before taking its reciprocal; as fp32 that is a subnormal.
ABSMAX_FLOOR = 1e-38
# bitsandbytes' CPU 8-bit quantizer maps [-1, 1] onto this many table entries.
DYNAMIC_LUT_SIZE = 65536


def nf4_midpoints(device: torch.device | str | None = None) -> torch.Tensor:
    """The 15 decision boundaries between consecutive NF4 values, rounded to fp32 as torch does."""
    code = nf4_code(device)
    return (code[:-1] + code[1:]) / 2


def _check_blocksize(blocksize: int) -> None:
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, got {blocksize}")


def quantize_nf4(x: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, fp32/fp16/bf16) to NF4.

    Returns ``(packed, absmax)``: ``packed`` uint8 [ceil(numel / 2)] with two codes per byte,
    high nibble first (the bytes of ``bitsandbytes.functional.quantize_4bit(...)[0]``), and
    ``absmax`` fp32 [ceil(numel / blocksize)].
    """
    _check_blocksize(blocksize)
    flat = x.reshape(-1).float()
    n = flat.numel()
    full = n - n % blocksize
    full_blocks = flat[:full].view(-1, blocksize)
    absmax = full_blocks.abs().amax(dim=1) if full else flat.new_empty(0)
    scaled = (full_blocks * (1.0 / absmax.clamp(min=ABSMAX_FLOOR)).unsqueeze(1)).reshape(-1)
    if full < n:
        # bitsandbytes quirk: the partial last block divides (not multiplies by the reciprocal)
        # and stores its absmax clamped to the floor.
        tail_absmax = flat[full:].abs().amax().clamp(min=ABSMAX_FLOOR)
        absmax = torch.cat([absmax, tail_absmax.view(1)])
        scaled = torch.cat([scaled, flat[full:] / tail_absmax])
    scaled = scaled.clamp(-1.0, 1.0)
    codes = torch.bucketize(scaled, nf4_midpoints(x.device)).to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_full((1,), PAD_CODE)])
    packed = (codes[0::2] << 4) | codes[1::2]
    return packed, absmax


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4`: ``code[nibble] * absmax[block]`` in fp32, rounded to dtype."""
    n = math.prod(shape)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()
    values = nf4_code(packed.device)[codes]
    block_of = torch.arange(n, device=packed.device) // blocksize
    return (values * absmax.float()[block_of]).to(dtype).reshape(shape)


def _dynamic_lookup_table(code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU table from [-1, 1] (65536 steps) to the index of the nearest-ish code."""
    midpoints = 0.5 * (code[:-1] + code[1:])
    steps = torch.arange(DYNAMIC_LUT_SIZE, dtype=torch.float32, device=code.device)
    grid = (2.0 * steps) / float(DYNAMIC_LUT_SIZE - 1) - 1.0
    # Entry i is the number of midpoints strictly below grid[i] (a merge of two sorted lists).
    return torch.searchsorted(midpoints, grid, side="left").to(torch.uint8)


def quantize_dynamic8(
    x: torch.Tensor, code: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit blockwise quantization as bitsandbytes 0.50's CPU kernel does it (fp32 input).

    absmax ignores NaN and is at least 0; an all-zero block stores codes 0. Each value is scaled
    by ``1 / absmax``, clamped, and mapped to table index
    ``trunc(fma((v + 1) * 0.5, 65535, 0.5))`` (NaN to index 0).
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = num_blocks(n, blocksize)
    padded = torch.nn.functional.pad(flat, (0, nb * blocksize - n)).view(nb, blocksize)
    magnitude = padded.abs()
    absmax = torch.where(torch.isnan(magnitude), 0.0, magnitude).amax(dim=1)
    inverse = (1.0 / absmax).unsqueeze(1)
    scaled = (padded * inverse).clamp(-1.0, 1.0).reshape(-1)[:n]
    # (v + 1) * 0.5 is exact in fp32 here; fp64 then makes "* 65535 + 0.5" exact before the
    # single rounding to fp32 that the fused multiply-add performs.
    half = (scaled + 1.0) * 0.5
    index = (half.double() * (DYNAMIC_LUT_SIZE - 1) + 0.5).float().trunc()
    index = torch.where(torch.isnan(index), torch.zeros_like(index), index).long()
    q = _dynamic_lookup_table(code)[index]
    zero_block = (absmax == 0).repeat_interleave(blocksize)[:n]
    q = torch.where(zero_block, torch.zeros_like(q), q)
    return q, absmax


def dequantize_dynamic8(
    q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE
) -> torch.Tensor:
    """``code[q] * absmax[block]`` in fp32 (bitsandbytes' dequantize_blockwise)."""
    n = q.numel()
    block_of = torch.arange(n, device=q.device) // blocksize
    return code[q.long()] * absmax[block_of]


def quantize_absmax(
    absmax: torch.Tensor, code: torch.Tensor, nested_blocksize: int = NESTED_BLOCKSIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantization: ``(absmax_q uint8, nested_absmax fp32, nested_offset 0-d fp32)``."""
    offset = absmax.mean()
    absmax_q, nested_absmax = quantize_dynamic8(absmax - offset, code, nested_blocksize)
    return absmax_q, nested_absmax, offset


def dequantize_absmax(
    absmax_q: torch.Tensor,
    nested_absmax: torch.Tensor,
    nested_offset: torch.Tensor,
    code: torch.Tensor,
    nested_blocksize: int = NESTED_BLOCKSIZE,
) -> torch.Tensor:
    """Per-block fp32 absmax from its double-quantized form (two roundings: product, then sum)."""
    return dequantize_dynamic8(absmax_q, nested_absmax, code, nested_blocksize) + nested_offset
