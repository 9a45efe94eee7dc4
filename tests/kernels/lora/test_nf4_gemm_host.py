"""The Hopper QLoRA GEMM's decode and checks, run on the host (pykernels._C.host_logic): the NF4
codes are decoded to bf16 in the mainloop's registers with byte permutes (nf4/nf4_decode_bf16.h),
then multiplied by the block's fp32 absmax (nf4/nf4_gemm_sm90.h). bitsandbytes is the oracle: its
code table, its packing and its dequantized weight. The GEMM itself needs a GPU
(tests/kernels/lora/test_lora_cuda.py)."""

import bnb_oracle
import bitsandbytes.functional as F
import numpy as np
import pytest
import torch

from pykernels import _C

H = _C.host_logic


def bf16_bits(values: torch.Tensor) -> list[int]:
    return (values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF).tolist()


def ptx_prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32's default mode as its ISA text states it."""
    source = a | (b << 32)
    out = 0
    for i in range(4):
        s = (selector >> (4 * i)) & 0xF
        byte = (source >> (8 * (s & 7))) & 0xFF
        if s & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def test_code_table_is_bitsandbytes_nf4_in_bf16():
    assert H.nf4_code_bf16 == bf16_bits(F.get_4bit_type("nf4", device="cpu"))


def test_byte_perm_host_twin_follows_ptx():
    rng = np.random.default_rng(0)
    for a, b, s in rng.integers(0, 2**32, size=(2000, 3), dtype=np.uint64).tolist():
        assert H.nf4_byte_perm(a, b, s) == ptx_prmt(a, b, s)


def decoded_elements(words: list[int]) -> list[int]:
    """bf16 bits of each element, in element order, from the kernel's decode of each word."""
    out = []
    for word in words:
        for pair in H.nf4_decode_word_bf16(word):
            out += [pair & 0xFFFF, pair >> 16]
    return out


def test_decode_every_byte_in_every_position():
    """Each of the 256 bytes (two codes) in each of a word's 4 bytes: element 2j is byte j's high
    nibble (bitsandbytes' packing), decoded to the code value's bf16."""
    table = H.nf4_code_bf16
    for position in range(4):
        for byte in range(256):
            word = (byte << (8 * position)) | (0x77 << (8 * ((position + 1) % 4)))  # neighbours: code 7
            decoded = decoded_elements([word])
            assert decoded[2 * position] == table[byte >> 4], (position, byte)
            assert decoded[2 * position + 1] == table[byte & 0xF], (position, byte)
            others = [v for i, v in enumerate(decoded) if i // 2 != position]
            assert others.count(table[7]) == 2 and others.count(table[0]) == 4  # untouched bytes


def packed_words(packed: torch.Tensor) -> list[int]:
    return packed.contiguous().view(torch.int32).to(torch.int64).bitwise_and(0xFFFFFFFF).tolist()


@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "double_quant"])
@pytest.mark.parametrize("blocksize", [64, 256])
def test_mainloop_weight_within_one_ulp_of_bitsandbytes(blocksize, double_quant):
    """The kernel's weight, bf16(bf16(code value) * absmax) from the decode of bitsandbytes' own
    packed bytes, against bitsandbytes' dequantized bf16 weight (one rounding of the fp32 product):
    at most 1 ulp apart, most of them equal (an fp32 decode would be exact, at twice the byte
    permutes)."""
    n, k = 24, 512
    g = torch.Generator().manual_seed(blocksize)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    packed, state = bnb_oracle.quantize(w.to(torch.bfloat16), blocksize, double_quant)
    expected = bnb_oracle.dequantize(packed, state, torch.bfloat16).reshape(-1)

    codes = torch.tensor(decoded_elements(packed_words(packed)), dtype=torch.int32).to(torch.int16)
    code_values = codes.view(torch.bfloat16).float()
    absmax = bnb_oracle.absmax_fp32(state).repeat_interleave(blocksize)
    ours = (code_values * absmax).to(torch.bfloat16)
    ulps = (ours.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1
    assert (ulps == 0).float().mean().item() > 0.5


@pytest.mark.parametrize(("rows", "groups"), [(1, 1), (8, 1), (1, 64), (24, 7), (4104, 64)])
def test_scale_operand_is_the_absmax_transposed(rows, groups):
    """nf4.cu's transposed_scales_kernel writes output o from block transposed_scale_block(o): the
    GEMM's M-major [groups, rows] scale operand is bitsandbytes' [rows, groups] absmax transposed."""
    absmax = np.arange(rows * groups)
    gathered = [absmax[H.nf4_transposed_scale_block(o, rows, groups)] for o in range(rows * groups)]
    assert gathered == absmax.reshape(rows, groups).T.reshape(-1).tolist()


@pytest.mark.parametrize(
    ("m", "n", "k", "blocksize", "misaligned", "error"),
    [
        (8192, 14336, 4096, 64, False, None),
        (1, 8, 64, 64, False, None),
        (7, 4096, 4096, 4096, False, None),
        (0, 4096, 4096, 64, False, "sizes"),
        (8, 4096, 4096, 32, False, "blocksize"),
        (8, 4096, 4160, 128, False, "blocksize"),
        (8, 4100, 4096, 64, False, "out_features"),
        (8, 4096, 4096, 64, True, "aligned"),
    ],
)
def test_gemm_check(m, n, k, blocksize, misaligned, error):
    message = H.nf4_gemm_sm90_error(m, n, k, blocksize, misaligned)
    assert (message is None) if error is None else (error in message)


def test_knob():
    assert H.nf4_sm90_forward(None) == "dequantize"
    assert H.nf4_sm90_forward("") == "dequantize"
    assert H.nf4_sm90_forward("dequantize") == "dequantize"
    assert H.nf4_sm90_forward("mainloop") == "mainloop"
    with pytest.raises(ValueError, match="PYKERNELS_SM90_NF4 must be dequantize"):
        H.nf4_sm90_forward("fused")
