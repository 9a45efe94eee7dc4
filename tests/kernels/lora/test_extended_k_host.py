"""The Hopper LoRA forward's operands and checks, run on the host (pykernels._C.host_logic): the LoRA
term and bias as extra K of the base GEMM (lora/lora_extended_k.h), y = [x | U] [W | V]^T. U and V
are bf16, yet the product U V^T must keep PEFT's fp32 adapters' precision; fp64 numpy is the oracle.
The GEMM itself needs a GPU (tests/kernels/lora/test_lora_cuda.py)."""

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


def test_lora_forward_sm90_accepts_the_shapes_users_train():
    for m, n, k in [(8192, 14336, 4096), (1, 8, 8), (37, 4096, 4104), (8192, 4096, 14336)]:
        assert H.lora_forward_sm90_error(m, n, k, ldx=k, ldw=k, extra_k=64, ldy=n) == ""
    assert H.lora_forward_sm90_error(8192, 2048, 4096, ldx=4096, ldw=4096, extra_k=192, ldy=14336) == ""  # a chunk


@pytest.mark.parametrize("change, message", [
    (dict(m=0), "GEMM sizes"), (dict(extra_k=0), "multiple of 64"), (dict(extra_k=48), "multiple of 64"),
    (dict(k=4100, ldx=4100, ldw=4100), "multiples of 8"), (dict(n=14330, ldy=14330), "multiples of 8"),
    (dict(ldy=8), "row stride"), (dict(ldx=4097), "row stride"), (dict(misaligned=True), "16-byte aligned")])
def test_lora_forward_sm90_refuses_what_tma_cannot_load(change, message):
    args = dict(m=8192, n=14336, k=4096, ldx=4096, ldw=4096, extra_k=64, ldy=14336) | change
    assert message in H.lora_forward_sm90_error(**args)


def test_lora_forward_knob():
    assert [H.lora_sm90_forward(s) for s in (None, "", "cublas", "extended_k")] == [
        "cublas", "cublas", "cublas", "extended_k"]
    with pytest.raises(ValueError, match="cublas .the default. or extended_k"):
        H.lora_sm90_forward("fused")


def test_the_sweep_times_every_lora_forward():
    """benchmarks/tile_sweep.py's choices are the knob's (its first, the baseline, the default)."""
    from benchmarks.tile_sweep import LORA_FORWARDS

    assert [H.lora_sm90_forward(name) for name in LORA_FORWARDS] == list(LORA_FORWARDS)
    assert H.lora_sm90_forward(None) == LORA_FORWARDS[0]


def test_moe_lora_knob_and_the_sweep():
    """PYKERNELS_SM90_MOE_LORA (moe/moe.h): extra K by default; the sweep times every choice."""
    from benchmarks.tile_sweep import MOE_LORAS

    assert [H.moe_sm90_lora(s) for s in (None, "", *MOE_LORAS)] == ["extra_k", "extra_k", *MOE_LORAS]
    with pytest.raises(ValueError, match="extra_k .the default. or separate"):
        H.moe_sm90_lora("fused")
