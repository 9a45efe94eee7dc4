"""NF4 quantize/dequantize are bit-exact with bitsandbytes 0.50 on CPU (every SIMD path)."""

import random

import bnb_oracle
import pytest
import torch

import pykernels.nf4 as nf4
from pykernels.reference import nf4 as reference
from tests.conftest import cpu_isas, forced_cpu_isa

SHAPES = [(1,), (2,), (7,), (83,), (769,), (5125,), (7, 769), (3, 5, 83), (64, 4096), (2, 4127)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKSIZES = reference.BLOCKSIZES


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_matches_bitsandbytes(x: torch.Tensor, blocksize: int, double_quant: bool) -> None:
    ours = nf4.quantize(x, blocksize=blocksize, double_quant=double_quant)
    packed, state = bnb_oracle.quantize(x, blocksize, double_quant)
    assert_bits_equal(ours.packed, packed, "packed")
    if double_quant:
        assert_bits_equal(ours.absmax_q, state.absmax, "absmax_q")
        assert_bits_equal(ours.nested_absmax, state.state2.absmax, "nested_absmax")
        assert_bits_equal(ours.nested_offset, state.offset, "nested_offset")
        assert_bits_equal(ours.nested_code, state.state2.code, "nested_code")
    else:
        assert_bits_equal(ours.absmax, state.absmax, "absmax")
    for dtype in DTYPES:
        expected = bnb_oracle.dequantize(packed, state, dtype)
        assert_bits_equal(nf4.dequantize(ours, dtype), expected, f"dequantize {dtype}")
        buffer = torch.full(x.shape, float("nan"), dtype=dtype)  # every value must be written over
        assert_bits_equal(nf4.dequantize(ours, out=buffer), expected, f"dequantize into out {dtype}")
    if bnb_oracle.native_dequantize_is_correct(x.shape, blocksize):
        expected = bnb_oracle.dequantize_public(packed.reshape(-1, 1), state)
        assert_bits_equal(nf4.dequantize(ours), expected, "dequantize vs bitsandbytes' native kernel")


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_bitsandbytes(shape, dtype, blocksize, double_quant, avx2_cpu_isa):
    generator = torch.Generator().manual_seed(hash((shape, blocksize)) % 2**31)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    assert_matches_bitsandbytes(x, blocksize, double_quant)


def test_random_shapes_match_bitsandbytes(avx2_cpu_isa):
    rng = random.Random(1234)
    for _ in range(150):
        shape = tuple(rng.randint(1, 97) for _ in range(rng.randint(1, 3)))
        dtype = rng.choice(DTYPES)
        scale = 10 ** rng.uniform(-4, 4)
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(rng.getrandbits(31))) * scale).to(dtype)
        assert_matches_bitsandbytes(x, rng.choice(BLOCKSIZES), rng.random() < 0.5)


def special_values(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(1000, generator=generator)
    with_inf, with_nan, half_zero = base.clone(), base.clone(), base.clone()
    with_inf[5] = float("inf")
    with_inf[300] = -float("inf")
    with_nan[70] = float("nan")
    half_zero[:500] = 0
    finfo = torch.finfo(dtype)
    return {
        "zeros": torch.zeros(1000),
        "constant": torch.full((1000,), 0.37),
        "half zero": half_zero,
        "inf": with_inf,
        "nan": with_nan,
        "huge": base * finfo.max / 8,
        "tiny": base * finfo.tiny,
        "midpoints": torch.cat([reference.nf4_midpoints(), -reference.nf4_midpoints(), torch.ones(2)]),
        "zero tail block": torch.cat([base[:128], torch.zeros(37)]),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(special_values(torch.float32)))
@pytest.mark.parametrize("double_quant", [False, True])
def test_special_values_match_bitsandbytes(case, dtype, double_quant, avx2_cpu_isa):
    x = special_values(dtype)[case].to(dtype)
    for blocksize in (32, 64, 256):
        assert_matches_bitsandbytes(x, blocksize, double_quant)


@pytest.mark.parametrize("layout", ["transposed", "strided", "offset"])
def test_non_contiguous_input_is_quantized_in_logical_order(layout, avx2_cpu_isa):
    base = torch.randn(96, 130, dtype=torch.bfloat16)
    x = {"transposed": base.t(), "strided": base[:, ::3], "offset": base[5:, 7:]}[layout]
    assert not x.is_contiguous()
    assert_matches_bitsandbytes(x, 64, double_quant=True)


@pytest.mark.parametrize("isa", [isa for isa in cpu_isas(avx2=True) if isa != "scalar"])
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_scalar_and_vector_paths_agree(isa, x_dtype):
    """Quantize from each input dtype (a block with inf, one with NaN, a zero block, values at every
    midpoint, a partial last block) and dequantize to each, every vector path against the portable one."""
    x = torch.randn(3, 4096 + 96) * 3
    x[0, 40], x[1, 1000], x[2, 300:428] = float("inf"), float("nan"), 0.0
    x[2, 1024:1024 + 30] = torch.cat([reference.nf4_midpoints(), -reference.nf4_midpoints()])
    x = x.to(x_dtype)
    results = {}
    for path in ("scalar", isa):
        with forced_cpu_isa(path):
            single, double = nf4.quantize(x, 128, double_quant=False), nf4.quantize(x, 64, double_quant=True)
            results[path] = (single.packed, single.absmax, double.packed, double.absmax_q,
                             *(nf4.dequantize(double, dtype) for dtype in DTYPES))
    for a, b in zip(results["scalar"], results[isa], strict=True):
        assert_bits_equal(b, a, isa)


@pytest.mark.parametrize("blocksize", [64, 256, 1024])
def test_dynamic8_matches_bitsandbytes_quantize_blockwise(blocksize, cpu_isa):
    import bitsandbytes.functional as F

    from pykernels._extension import ops

    code = reference.dynamic_map()
    assert torch.equal(code, F.create_dynamic_map())
    generator = torch.Generator().manual_seed(blocksize)
    for x in (torch.randn(5000, generator=generator), torch.rand(777, generator=generator) - 0.3,
              torch.zeros(blocksize + 3), code.clone()):
        q, absmax = ops.dynamic8_quantize(x, code, blocksize)
        expected_q, state = F.quantize_blockwise(x, blocksize=blocksize)
        assert_bits_equal(q, expected_q.reshape(-1), "q")
        assert_bits_equal(absmax, state.absmax, "absmax")
        assert_bits_equal(ops.dynamic8_dequantize(q, absmax, code, blocksize),
                          F.dequantize_blockwise(expected_q, state), "dequantize")


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", [(1,), (769,), (7, 769)])
def test_reference_matches_bitsandbytes(shape, double_quant):
    """The pure-torch reference (fallback and benchmark baseline) is itself bit-exact."""
    x = torch.randn(shape, dtype=torch.bfloat16)
    packed, state = bnb_oracle.quantize(x, 64, double_quant)
    ref_packed, ref_absmax = reference.quantize_nf4(x, 64)
    assert_bits_equal(ref_packed, packed, "packed")
    if double_quant:
        absmax_q, nested_absmax, offset = reference.quantize_absmax(ref_absmax, reference.dynamic_map())
        assert_bits_equal(absmax_q, state.absmax, "absmax_q")
        assert_bits_equal(nested_absmax, state.state2.absmax, "nested_absmax")
        ref_absmax = reference.dequantize_absmax(absmax_q, nested_absmax, offset, reference.dynamic_map())
    else:
        assert_bits_equal(ref_absmax, state.absmax, "absmax")
    assert_bits_equal(reference.dequantize_nf4(ref_packed, ref_absmax, 64, x.shape, x.dtype),
                      bnb_oracle.dequantize(packed, state), "dequantize")


def values_straddling(boundaries: torch.Tensor, scale: float, ulps: int = 3) -> torch.Tensor:
    """fp32 values within a few ulps of each boundary * scale, where one rounding decides the code."""
    centers = (boundaries.double() * scale).float()
    values = [centers]
    up, down = centers.clone(), centers.clone()
    for _ in range(ulps):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, -float("inf")))
        values += [up, down]
    return torch.cat(values)


@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_values_at_nf4_decision_boundaries_match_bitsandbytes(blocksize, avx2_cpu_isa):
    """Full blocks scale by x * (1 / absmax), the partial last block by x / absmax: at the
    midpoints the two differ by an ulp and pick different codes, so both are pinned here."""
    generator = torch.Generator().manual_seed(blocksize)
    for absmax in (1.0, 0.37, 3.0e-3, 123.456, *(torch.rand(8, generator=generator) * 10).tolist()):
        edges = values_straddling(torch.cat([reference.nf4_midpoints(), -reference.nf4_midpoints()]), absmax)
        block = torch.cat([torch.tensor([absmax], dtype=torch.float32), edges])
        full = block.repeat(-(-blocksize // block.numel()))[:blocksize]
        full[0] = absmax
        for x in (torch.cat([full, block]), torch.cat([full, full])):  # partial tail / all full
            assert_matches_bitsandbytes(x, blocksize, double_quant=False)


def test_values_at_dynamic8_table_edges_match_bitsandbytes():
    """bitsandbytes indexes its 65536-entry table with trunc(fma((v + 1) / 2, 65535, 0.5)): values
    whose index sits on an integer boundary pin that rounding (offset, truncation)."""
    import bitsandbytes.functional as F

    from pykernels._extension import ops

    steps = torch.arange(1, 65535, 7, dtype=torch.float64)
    boundaries = ((steps - 0.5) / 65535 * 2 - 1).float()
    x = torch.cat([torch.ones(1), values_straddling(boundaries, 1.0, ulps=2)])
    code = reference.dynamic_map()
    for blocksize in (256, 4096):
        q, absmax = ops.dynamic8_quantize(x, code, blocksize)
        expected_q, state = F.quantize_blockwise(x, blocksize=blocksize)
        padded = torch.cat([x[: blocksize - 1], torch.ones(1)])  # one block with absmax exactly 1
        assert_bits_equal(q, expected_q, "q")
        assert_bits_equal(absmax, state.absmax, "absmax")
        assert_bits_equal(ops.dynamic8_quantize(padded, code, blocksize)[0],
                          F.quantize_blockwise(padded, blocksize=blocksize)[0], "q (absmax 1)")
