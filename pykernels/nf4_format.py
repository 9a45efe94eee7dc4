"""The NF4 storage format shared by the ops, NF4Weight and the pure-torch reference: block sizes,
the NF4 code book, bitsandbytes' 8-bit dynamic map (double quantization of absmax), block counts.
Definitions only: pykernels/reference/nf4.py states the quantization algorithm on top of them.
"""

from __future__ import annotations

import torch

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256  # bitsandbytes quantizes absmax in blocks of 256 (quantize_4bit)
PAD_CODE = 7  # code of 0.0: an odd numel pads the last byte's low nibble with it

# NF4 code book (bitsandbytes.functional.get_4bit_type("nf4")), sorted ascending.
NF4_CODE_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

def nf4_code(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 NF4 values as fp32 (bitsandbytes' ``quant_map``)."""
    return torch.tensor(NF4_CODE_VALUES, dtype=torch.float32, device=device)


def dynamic_map(device: torch.device | str | None = None) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``): 256 sorted fp32 values.

    Dynamic exponent plus a linear fraction whose width shrinks as the exponent grows
    (Dettmers 2015, https://arxiv.org/abs/1511.04561). Computed with the same fp32 linspace
    and Python float arithmetic as bitsandbytes so the table is identical bit for bit.
    """
    max_exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        data += (-scale * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    data.sort()
    return torch.tensor(data, dtype=torch.float32, device=device)


def num_blocks(numel: int, blocksize: int) -> int:
    return -(-numel // blocksize)
