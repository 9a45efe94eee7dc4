"""lora/lora_rank_pieces.h on the host (pykernels._C.host_logic): fp32 LoRA factors as three bf16
pieces, and the five rank products composed from the blocked operands exactly as
csrc/lora/lora_cuda_torch.cpp composes them (PYKERNELS_LORA_RANK_GEMM=tensor_core), against fp64."""

import math

import pytest
import torch

from pykernels import _C

H = _C.host_logic


def test_rank_gemm_knob():
    assert [H.lora_rank_gemm(s) for s in (None, "", "simt", "tensor_core")] == [
        "tensor_core", "tensor_core", "simt", "tensor_core"]
    with pytest.raises(ValueError, match=r"PYKERNELS_LORA_RANK_GEMM must be tensor_core \(the default\) or simt"):
        H.lora_rank_gemm("tf32")


def bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).bfloat16().item()


SUBNORMAL_STEP = 2.0**-133  # bf16's smallest subnormal: a subnormal piece is exact to half of it


@pytest.mark.parametrize("value", [0.0, -0.0, 1.0, 1 / 3, -2.718281828, 3.38e38, -1.17549435e-38, 1e-40, 12345.678,
                                   0.1, -7.5e-6, 3.4e38, -3.4028235e38])
def test_three_pieces_are_bf16_and_sum_to_the_value(value):
    f = torch.tensor(value, dtype=torch.float32).item()  # the fp32 value
    hi, mid, lo = (H.lora_bf16_piece(f, p) for p in range(3))
    # round to nearest even, as torch, unless that overflows bf16 (above 3.39e38): then truncated
    assert hi == (bf16(f) if math.isfinite(bf16(f)) else math.copysign(3.3895313892515355e38, f))
    for piece in (hi, mid, lo):
        assert math.isfinite(piece) and bf16(piece) == piece, piece
    assert abs(f - (hi + mid + lo)) <= 2.0**-24 * abs(f) + SUBNORMAL_STEP, (f, hi, mid, lo)  # fp64 sums: exact


def test_non_finite_values_are_their_own_hi():
    assert [H.lora_bf16_piece(math.inf, p) for p in range(3)] == [math.inf, 0.0, 0.0]
    assert math.isnan(H.lora_bf16_piece(math.nan, 0)) and H.lora_bf16_piece(math.nan, 2) == 0.0


def blocked(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The bf16 operand lora_cuda_torch.cpp builds from the fp32 matrix t, as fp64."""
    rows, cols = t.shape
    values = torch.tensor(H.lora_split_pieces(t.flatten().tolist(), rows, cols, layout), dtype=torch.float64)
    blocks = 6 if layout.endswith("_term") else 3
    stacked = layout in ("stacked", "a_term")
    return values.view(blocks * rows, cols) if stacked else values.view(rows, blocks * cols)


def summed(product: torch.Tensor, rows: int, cols: int, stacked: bool) -> torch.Tensor:
    """The sum pass over a product the tensor cores left in fp32."""
    p32 = product.float().flatten().tolist()
    return torch.tensor(H.lora_sum_pieces(p32, rows, cols, stacked), dtype=torch.float64).view(rows, cols)


M, K, N, R, S = 7, 13, 11, 3, 2.0  # odd sizes: a transposed block or a wrong stride shows


@pytest.fixture
def factors():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=g).bfloat16().double()  # bf16 activations: exact in every piece product
    dy = torch.randn(M, N, generator=g).bfloat16().double()
    a, b = torch.randn(R, K, generator=g), torch.randn(N, R, generator=g)  # fp32 adapters
    xa, dxa = (x @ a.double().T).float(), (S * dy @ b.double()).float()  # fp32 intermediates
    return x, dy, a, b, xa, dxa


def products(x, dy, a, b, xa, dxa):
    """(name, ours, exact) for each product, its operands and sums laid out as the CUDA op's."""
    return [
        ("xa", summed(x @ blocked(a, "stacked").T, M, R, False), x @ a.double().T),
        ("dxa", summed(S * dy @ blocked(b, "side_by_side"), M, R, False), S * dy @ b.double()),
        ("dB", summed(S * dy.T @ blocked(xa, "side_by_side"), N, R, False), S * dy.T @ xa.double()),
        ("dA", summed(blocked(dxa, "side_by_side").T @ x, R, K, True), dxa.double().T @ x),
        ("dxa A", blocked(dxa, "dxa_term") @ blocked(a, "a_term"), dxa.double() @ a.double()),
    ]


def test_products_from_pieces_match_fp64(factors):
    """Each product through its pieces lands within fp32 rounding of the fp64 product of the fp32
    factors (a bf16 rounding of a factor would cost ~2^-9)."""
    for name, ours, exact in products(*factors):
        err = (ours - exact).abs().max().item()
        assert err <= 2.0**-21 * exact.abs().max().item(), f"{name}: |ours - fp64| = {err:.3g}"


def test_a_wrong_layout_is_caught(factors):
    """The check above can fail: A's pieces side by side where the GEMM wants them stacked."""
    x, _, a, *_ = factors
    wrong = blocked(a, "side_by_side").view(3 * R, K)  # the same numbers, the wrong blocks
    err = (summed(x @ wrong.T, M, R, False) - x @ a.double().T).abs().max().item()
    assert err > 1e-2
