"""The Hopper LoRA forward's operands and checks, run on the host (pykernels._C.host_logic): the LoRA
term and bias as extra K of the base GEMM (lora/lora_extended_k.h), y = [x | U] [W | V]^T. U and V
are bf16, yet the product U V^T must keep PEFT's fp32 adapters' precision; fp64 numpy is the oracle.
The GEMM itself needs a GPU (tests/kernels/lora/test_lora_cuda.py). Also the knobs of both extra-K
users: the dense LoRA forward's and the MoE experts' LoRA."""

import numpy as np
import pytest
import torch

from pykernels import _C

H = _C.host_logic


def bf16(values: np.ndarray) -> np.ndarray:
    """values rounded to bf16 by torch (round to nearest even), as float64."""
    return torch.from_numpy(np.asarray(values, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def operands(m, n, r, b_is_fp32, with_bias, scaling=2.0, seed=0):
    rng = np.random.default_rng(seed)
    xa = (rng.standard_normal((m, r)) * rng.choice([1e-3, 1.0, 30.0], size=(m, 1))).astype(np.float32)
    b = (rng.standard_normal((n, r)) * 0.01).astype(np.float32)
    if not b_is_fp32:
        b = bf16(b).astype(np.float32)
    bias = bf16(rng.standard_normal(n)).astype(np.float32) if with_bias else np.zeros(0, np.float32)
    terms, width, u, v = H.lora_extended_k_operands(xa.tolist(), b.tolist(), bias.tolist(), scaling, b_is_fp32)
    return xa, b, bias, terms, width, np.array(u, np.float64), np.array(v, np.float64)


@pytest.mark.parametrize("r", [1, 7, 16, 21, 22, 64])
@pytest.mark.parametrize("b_is_fp32", [True, False], ids=["fp32_adapters", "bf16_adapters"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_extended_k_keeps_the_lora_term_at_fp32_precision(r, b_is_fp32, with_bias):
    """U V^T = scaling xa B^T + bias within ~2^-16 of each term's size (hi/lo halves of both fp32
    factors), where one bf16 rounding of the factors (what a plain bf16 GEMM would do) is off by
    ~2^-9: the check below fails for that, so it can tell the two apart."""
    m, n, scaling = 37, 29, 2.0
    xa, b, bias, terms, width, u, v = operands(m, n, r, b_is_fp32, with_bias, scaling)
    s_xa = scaling * xa.astype(np.float64)
    exact = s_xa @ b.astype(np.float64).T + (bias.astype(np.float64) if with_bias else 0.0)
    size = np.abs(s_xa) @ np.abs(b.astype(np.float64)).T  # the term's magnitude per element
    bound = 2.0 ** -15 * size
    assert np.all(np.abs(u @ v.T - exact) <= bound)

    plain = bf16(s_xa) @ bf16(b).T + (bias if with_bias else 0.0)  # one bf16 rounding of each factor
    assert np.any(np.abs(plain - exact) > bound)


@pytest.mark.parametrize("r, b_is_fp32, with_bias, terms, width", [
    (16, True, False, 3, 64), (21, True, False, 3, 64), (21, True, True, 3, 64), (22, True, False, 3, 128),
    (16, False, True, 2, 64), (32, False, False, 2, 64), (32, False, True, 2, 128), (64, True, True, 3, 256)])
def test_extended_k_width_is_whole_k_tiles_and_the_rest_is_zero(r, b_is_fp32, with_bias, terms, width):
    """The mainloop takes whole 64-deep k tiles from U and V: the width rounds the used columns
    (terms r, + 1 for the bias) up to them, and the padding must be zeros in both (TMA reads it)."""
    _, _, bias, got_terms, got_width, u, v = operands(5, 3, r, b_is_fp32, with_bias)
    assert (got_terms, got_width) == (terms, width)
    assert width % H.lora_extended_k_tile == 0
    used = terms * r
    if with_bias:
        assert np.all(u[:, used] == 1.0) and np.array_equal(v[:, used], bias.astype(np.float64))
        used += 1
    assert np.all(u[:, used:] == 0.0) and np.all(v[:, used:] == 0.0)
    assert u.shape[1] == v.shape[1] == width


def test_extended_k_operands_are_bf16_values():
    """The packing kernel stores U and V in bf16: every value it computes must already be one, or
    the store would round a second time."""
    _, _, _, _, _, u, v = operands(11, 13, 16, True, True)
    assert np.array_equal(bf16(u), u) and np.array_equal(bf16(v), v)


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(1)
    values = np.concatenate([
        rng.standard_normal(2000).astype(np.float32) * np.float32(10.0) ** rng.integers(-30, 30, 2000),
        np.array([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1e-40, -1e-42, 3.39e38, np.inf, -np.inf],
                 np.float32)]).astype(np.float32)
    ours = np.array([H.lora_bf16_rounded(float(value)) for value in values])
    assert np.array_equal(ours, bf16(values))  # ties to even, subnormals, overflow to inf
    assert np.isnan(H.lora_bf16_rounded(float("nan")))


def test_the_forward_is_one_group_the_gemm_core_takes():
    """The extended forward runs on the Hopper core as one group with extra K (lora_cuda_torch.cpp):
    x [m, k] and W [n, k] K-major, U and V [*, width]; per NF4 chunk, a column slice of y (row stride
    n) against V's rows. What TMA cannot load is refused by the core's check."""
    shapes = [(14336, 4096, 64, 14336), (8, 8, 64, 8), (4096, 4104, 128, 4096), (2048, 4096, 192, 14336)]
    for n, k, width, ldy in shapes:  # the last: an NF4 chunk of 2048 rows of W, into y [m, 14336]
        assert H.gemm_sm90_extra_k_error("rows_k_major_b", n, k, k2=width, lda2=width, ldb2=width,
                                         b2_expert_stride=0, grouped=False, ldd=ldy) is None
    assert "16 bytes" in H.gemm_sm90_extra_k_error("rows_k_major_b", 4096, 4096, k2=64, lda2=60, ldb2=64,
                                                   b2_expert_stride=0, grouped=False)
    assert "16-byte aligned" in H.gemm_sm90_extra_k_error("rows_k_major_b", 4096, 4096, k2=64, lda2=64, ldb2=64,
                                                          b2_expert_stride=0, misaligned=True, grouped=False)


def test_lora_forward_and_grad_x_knobs():
    """PYKERNELS_SM90_LORA: extra K by default (the H100 sweep's pick); PYKERNELS_SM90_LORA_GRAD_X:
    cuBLAS by default (not yet timed on a GPU)."""
    assert [H.lora_sm90_forward(s) for s in (None, "", "cublas", "extended_k")] == [
        "extended_k", "extended_k", "cublas", "extended_k"]
    assert [H.lora_sm90_grad_x(s) for s in (None, "", "cublas", "extended_k")] == [
        "cublas", "cublas", "cublas", "extended_k"]
    with pytest.raises(ValueError, match="extended_k .the default. or cublas"):
        H.lora_sm90_forward("fused")
    with pytest.raises(ValueError, match="PYKERNELS_SM90_LORA_GRAD_X must be cublas .the default. or extended_k"):
        H.lora_sm90_grad_x("fused")


def test_the_sweep_times_every_lora_forward():
    """benchmarks/tile_sweep.py's choices are the knob's (its first, the baseline, the default)."""
    from benchmarks.tile_sweep import LORA_FORWARDS

    for choice in LORA_FORWARDS:  # "value@tile": the knob's value on one of the core's tiles
        value, _, tile = choice.partition("@")
        assert H.lora_sm90_forward(value) == value and tile in ("", *H.gemm_sm90_tiles)
    assert H.lora_sm90_forward(None) == LORA_FORWARDS[0]


def test_moe_lora_knob_and_the_sweep():
    """PYKERNELS_SM90_MOE_LORA (moe/moe.h): extra K by default; the sweep times every choice."""
    from benchmarks.tile_sweep import MOE_LORAS

    assert [H.moe_sm90_lora(s) for s in (None, "", *MOE_LORAS)] == ["extra_k", "extra_k", *MOE_LORAS]
    with pytest.raises(ValueError, match="extra_k .the default. or separate"):
        H.moe_sm90_lora("fused")


def test_moe_gather_knob_and_the_sweep():
    """PYKERNELS_SM90_MOE_GATHER (moe/moe.h): a gather pass by default, else in the GEMM's mainloop; the
    sweep times both."""
    from benchmarks.tile_sweep import MOE_GATHERS

    assert [H.moe_sm90_gather(s) for s in (None, "", *MOE_GATHERS)] == ["pass", "pass", *MOE_GATHERS]
    with pytest.raises(ValueError, match="pass .the default. or mainloop"):
        H.moe_sm90_gather("tma")


def test_moe_rank_tile_knob_and_the_sweep():
    """PYKERNELS_MOE_RANK_TILE (moe/moe.h): the experts' rank-r products on the 128 x 128 tile by default,
    else on 128 x 32; the sweep times both."""
    from benchmarks.tile_sweep import MOE_RANK_TILES

    assert [H.moe_rank_tile(s) for s in (None, "", *MOE_RANK_TILES)] == ["wide", "wide", *MOE_RANK_TILES]
    with pytest.raises(ValueError, match="wide .the default. or narrow"):
        H.moe_rank_tile("32")
