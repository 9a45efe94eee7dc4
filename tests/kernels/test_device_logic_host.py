"""The CUDA kernels' index/tile arithmetic, run on the host.

No CUDA kernel of this project has run on a GPU yet, and index arithmetic is where blind CUDA goes
wrong. The arithmetic lives in __host__ __device__ headers (csrc/common/tails.h,
common/online_softmax.h, common/gemm_groups.h, nf4/nf4_layout.h, moe/moe_schedule.h,
logprobs/vocab_chunks.h) that the .cu kernels call, and in the torch-free parameter logic of the
Hopper GEMM core (common/grouped_gemm_sm90.h, common/gemm_sm90_dense.h, common/sm90_tiles.h);
pykernels._C.host_logic compiles the same functions for the host. Each test
compares them with an independent Python computation (direct enumeration, fp64 math, bitsandbytes)
on adversarial sizes.
"""

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pykernels import _C

H = _C.host_logic
FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ MoE: buckets and row tiles
def bucket_ranges(offsets: list[int], slots: int) -> list[tuple[int, int]]:
    """Each bucket's slots, clamped into [0, slots]; the last bucket (dropped) runs to slots."""
    experts = len(offsets) - 1
    ranges = []
    for b in range(experts + 1):
        begin = min(max(offsets[b], 0), slots)
        end = min(max(offsets[b + 1], 0), slots) if b < experts else slots
        ranges.append((begin, max(begin, end)))
    return ranges


def schedule_oracle(offsets: list[int], slots: int, rows_per_tile: int) -> list[tuple[int, int, int]]:
    """(bucket, first slot, end slot) of each row tile in bucket order, then idle CTAs, for a grid of
    ceil(slots / R) + E + 1 CTAs."""
    tiles = [
        (b, first, min(first + rows_per_tile, end))
        for b, (begin, end) in enumerate(bucket_ranges(offsets, slots))
        for first in range(begin, end, rows_per_tile)
    ]
    grid = -(-slots // rows_per_tile) + len(offsets)
    tiles = tiles[:grid]
    return tiles + [(-1, 0, 0)] * (grid - len(tiles))


def offsets_of(counts: list[int]) -> tuple[list[int], int]:
    """expert_offsets [E + 1] and slots from per-bucket counts (the last count: dropped slots)."""
    offsets = [0]
    for c in counts[:-1]:
        offsets.append(offsets[-1] + c)
    return offsets, offsets[-1] + counts[-1]


ROWS_PER_TILE = [1, 7, 64, 128]  # 64: the SIMT kernel, 128: the tensor-core kernel

# (per-expert counts, dropped) of well-formed routings
ROUTINGS = {
    "T=1": [1, 0],
    "T=1 dropped": [0, 1],
    "no slots": [0, 0, 0],
    "zero-token experts": [0, 0, 5, 0, 0, 4, 0, 0],
    "one expert holds all": [0, 0, 0, 8 * 769, 0, 0, 0, 0, 0],
    "first holds all": [5125] + [0] * 63 + [0],
    "last holds all": [0] * 63 + [5125, 0],
    "tile-sized": [128, 64, 129, 127, 1, 0],
    "many experts": [random.Random(0).choice([0, 0, 1, 3, 17, 200]) for _ in range(512)] + [11],
    "all dropped": [0] * 8 + [83],
}


def check_schedule(offsets: list[int], slots: int, rows_per_tile: int, well_formed: bool) -> None:
    tiles = [tuple(t) for t in H.moe_row_tile_schedule(offsets, slots, rows_per_tile)]
    assert tiles == schedule_oracle(offsets, slots, rows_per_tile)
    assert len(tiles) == H.moe_max_row_tiles(slots, len(offsets) - 1, rows_per_tile)
    busy = [t for t in tiles if t[0] >= 0]
    assert tiles[len(busy):] == [(-1, 0, 0)] * (len(tiles) - len(busy)), "idle CTAs only at the end"
    ranges = bucket_ranges(offsets, slots)
    for bucket, first, end in busy:
        assert ranges[bucket][0] <= first < end <= ranges[bucket][1] and end - first <= rows_per_tile
    if well_formed:  # every slot in exactly one tile, of its own bucket
        covered = sorted(s for _, first, end in busy for s in range(first, end))
        assert covered == list(range(slots))


@pytest.mark.parametrize("rows_per_tile", ROWS_PER_TILE)
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_row_tile_schedule_adversarial(name, rows_per_tile):
    offsets, slots = offsets_of(ROUTINGS[name])
    check_schedule(offsets, slots, rows_per_tile, well_formed=True)


@FAST
@given(counts=st.lists(st.integers(0, 100) | st.just(0), min_size=2, max_size=80),
       rows_per_tile=st.sampled_from(ROWS_PER_TILE))
def test_row_tile_schedule_random(counts, rows_per_tile):
    offsets, slots = offsets_of(counts)
    check_schedule(offsets, slots, rows_per_tile, well_formed=True)


@FAST
@given(offsets=st.lists(st.integers(-5, 60), min_size=1, max_size=12), slots=st.integers(0, 50),
       rows_per_tile=st.sampled_from(ROWS_PER_TILE))
def test_row_tile_schedule_malformed_offsets_stay_in_bounds(offsets, slots, rows_per_tile):
    """Negative, decreasing or too large offsets: every tile still lies inside [0, slots] and its
    bucket's clamped range; overlapping ranges can need more tiles than the grid has (lost tiles,
    wrong numbers, no out-of-bounds access)."""
    assert [tuple(r) for r in H.moe_bucket_slots(offsets, slots)] == bucket_ranges(offsets, slots)
    check_schedule(offsets, slots, rows_per_tile, well_formed=False)


@pytest.mark.parametrize("row_tiles, column_tiles", [(1, 1), (7, 1), (1, 9), (13, 5), (1153, 12)])
def test_rows_grid_puts_column_tiles_innermost(row_tiles, column_tiles):
    """The rows GEMM's 1-D grid covers every (row tile, column tile) once, and consecutive CTAs walk
    one row tile's column tiles before the next row tile (its gathered rows stay in L2)."""
    tiles = [H.moe_grid_tile(c, column_tiles) for c in range(row_tiles * column_tiles)]
    assert tiles == [(r, c) for r in range(row_tiles) for c in range(column_tiles)]


# ------------------------------------------------------------------ the sm_90a grouped GEMM's problems
# common/grouped_gemm_sm90.cu hands CUTLASS one (M, N, K, A, B, D) problem per expert (or one for a
# dense GEMM), computed on the device by common/gemm_groups.h. Here the problems drive a numpy GEMM
# with CUTLASS's addressing (row-major: (i, j) at i * ld + j; column-major: at j * ld + i), every
# address checked against its buffer, and the result is compared with the per-expert products
# computed directly.
def view(buffer: np.ndarray, offset: int, rows: int, cols: int, ld: int, row_major: bool) -> np.ndarray:
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    index = offset + (i * ld + j if row_major else j * ld + i)
    assert index.size == 0 or (index.min() >= 0 and index.max() < buffer.size), "address outside the operand"
    return buffer[index]


def run_groups(kind, offsets, slots, a, b, d, zeros, *, m, n, k, lda, ldb, b_expert_stride, ldd, d_expert_stride,
               a_row_major, b_row_major):
    """d (flat, updated) as CUTLASS computes it from the problem list; returns the rows/entries written."""
    written = np.zeros(d.size, dtype=bool)
    for gm, gn, gk, a_off, b_off, d_off, use_zeros in H.gemm_sm90_groups(
            kind, offsets, slots, m, n, k, lda, ldb, b_expert_stride, ldd, d_expert_stride):
        assert gm * gn == 0 or gk >= 1, "CUTLASS leaves a K = 0 tile's accumulators unset"
        src_a, src_b = (zeros, zeros) if use_zeros else (a, b)
        op_a = view(src_a, a_off, gm, gk, lda, a_row_major)
        op_b = view(src_b, b_off, gk, gn, ldb, b_row_major)  # B as K x N
        i, j = np.meshgrid(np.arange(gm), np.arange(gn), indexing="ij")
        index = d_off + i * ldd + j
        assert index.size == 0 or (index.min() >= 0 and index.max() < d.size), "D outside its buffer"
        assert not written[index].any(), "two groups write one element"
        d[index] = op_a @ op_b
        written[index] = True
    return written


def routing_cases():
    return [offsets_of(counts) for name, counts in ROUTINGS.items() if name != "many experts" and sum(counts) < 2000]


@pytest.mark.parametrize("offsets, slots", routing_cases())
@pytest.mark.parametrize("k_major_b", [True, False])
def test_sm90_rows_groups_compute_each_experts_rows(offsets, slots, k_major_b):
    """Forward (weight [E, N, K], K-major) and grad_x (the same weight read as [E, K, N]) with a
    padded A (lda > k, like the LoRA activations): each kept slot's row is its expert's product,
    dropped slots' rows are not written."""
    rng = np.random.default_rng(slots)
    experts, n, k, lda = len(offsets) - 1, 24, 5, 8
    x = rng.standard_normal((slots, lda))
    w = rng.standard_normal((experts, n, k) if k_major_b else (experts, k, n))
    d = np.full(slots * n, np.nan)
    written = run_groups("rows", offsets, slots, x.ravel(), w.ravel(), d, None, m=0, n=n, k=k, lda=lda,
                         ldb=k if k_major_b else n, b_expert_stride=n * k, ldd=n, d_expert_stride=0,
                         a_row_major=True, b_row_major=not k_major_b)
    d = d.reshape(slots, n)
    for e in range(experts):
        for s in range(offsets[e], offsets[e + 1]):
            expected = x[s, :k] @ (w[e].T if k_major_b else w[e])
            np.testing.assert_allclose(d[s], expected, rtol=1e-12, atol=1e-12)
    dropped = np.arange(slots) >= offsets[-1]
    assert not written.reshape(slots, n)[dropped].any() and written.reshape(slots, n)[~dropped].all()


@pytest.mark.parametrize("offsets, slots", routing_cases())
def test_sm90_weight_grad_groups_sum_each_experts_slots(offsets, slots):
    """dW_e = sum over e's slots of dy_s^T x_s (dy read transposed), zeros for experts without slots
    (they read one column of the zero buffer instead of running K = 0), dropped slots not summed."""
    rng = np.random.default_rng(slots + 1)
    experts, m, n = len(offsets) - 1, 16, 24
    dy, x = rng.standard_normal((slots, m)), rng.standard_normal((slots, n))
    d = np.full(experts * m * n, np.nan)
    written = run_groups("weight_grad", offsets, slots, dy.ravel(), x.ravel(), d, np.zeros(max(m, n)), m=m, n=n,
                         k=0, lda=m, ldb=n, b_expert_stride=0, ldd=n, d_expert_stride=m * n, a_row_major=False,
                         b_row_major=True)
    assert written.all()
    d = d.reshape(experts, m, n)
    for e in range(experts):
        rows = slice(offsets[e], offsets[e + 1])
        np.testing.assert_allclose(d[e], dy[rows].T @ x[rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m, n, k", [(1, 8, 1), (37, 24, 13), (130, 136, 70)])
def test_sm90_dense_gemms_are_one_group(m, n, k):
    """The LoRA and logprobs ops' GEMMs (common/gemm_sm90_torch.h): offsets None is one group over
    every slot. x W^T and dz W run as rows problems with A's rows as slots (lda > k: a row stride
    wider than the product), dz^T h as a weight-gradient problem with the K rows as slots."""
    rng = np.random.default_rng(m)
    lda = k + 3
    a, w_nk, w_kn = rng.standard_normal((m, lda)), rng.standard_normal((n, k)), rng.standard_normal((k, n))
    for w, k_major in ((w_nk, True), (w_kn, False)):
        d = np.full(m * n, np.nan)
        run_groups("rows", None, m, a.ravel(), w.ravel(), d, None, m=0, n=n, k=k, lda=lda, ldb=k if k_major else n,
                   b_expert_stride=0, ldd=n, d_expert_stride=0, a_row_major=True, b_row_major=not k_major)
        np.testing.assert_allclose(d.reshape(m, n), a[:, :k] @ (w.T if k_major else w), rtol=1e-12, atol=1e-12)
    # D [m, n] = A^T B with A stored [k, m] (row stride m + 5), B stored [k, n]
    at, b = rng.standard_normal((k, m + 5)), rng.standard_normal((k, n))
    d = np.full(m * n, np.nan)
    run_groups("weight_grad", None, k, at.ravel(), b.ravel(), d, np.zeros(max(m, n)), m=m, n=n, k=0, lda=m + 5,
               ldb=n, b_expert_stride=0, ldd=n, d_expert_stride=0, a_row_major=False, b_row_major=True)
    np.testing.assert_allclose(d.reshape(m, n), at[:, :m].T @ b, rtol=1e-12, atol=1e-12)


# The dense GEMMs of the LoRA and logprobs ops as the CUDA bindings fill gemm::GemmParams
# (lora_cuda_torch.cpp, logprobs_cuda_torch.cpp): (m, n, k, lda, ldb, ldd, a_t, b_t, D, accumulate)
# -> the core's kind and its slots (the dimension its one group walks).
DENSE_CALLS = {
    "lora y += x W^T": ((8192, 14336, 4096, 4096, 4096, 14336, False, True, "bf16", True), ("rows_k_major_b", 8192)),
    "lora dx = dy W": ((8192, 4096, 14336, 14336, 4096, 4096, False, False, "bf16", False), ("rows_n_major_b", 8192)),
    "qlora dx += dy W_chunk (fp32)": ((8192, 4096, 1024, 14336, 4096, 4096, False, False, "fp32", True),
                                      ("rows_n_major_b", 8192)),
    "logits z = h W_c^T": ((512, 4096, 4096, 4096, 4096, 4096, False, True, "fp32", False), ("rows_k_major_b", 512)),
    "dh += dz W_c": ((512, 4096, 4096, 4096, 4096, 4096, False, False, "fp32", True), ("rows_n_major_b", 512)),
    "first dW_c = dz^T h": ((4096, 4096, 512, 4096, 4096, 4096, True, False, "fp32", False), ("weight_grad", 512)),
    "dW_c += dz^T h": ((4096, 4096, 512, 4096, 4096, 4096, True, False, "fp32", True), ("weight_grad", 512)),
}


@pytest.mark.parametrize("name", list(DENSE_CALLS))
def test_sm90_core_takes_the_dense_gemms_the_ops_make(name):
    """Each call pattern maps to its kind with the right dimension as slots, and the launcher's own
    check accepts the result (a dense A^T B once failed it: the check asked for the zero buffer
    that only grouped calls carry)."""
    (m, n, k, lda, ldb, ldd, a_t, b_t, d_dtype, accumulate), (kind, slots) = DENSE_CALLS[name]
    taken = H.gemm_sm90_dense(m, n, k, lda, ldb, ldd, a_t, b_t, "bf16", d_dtype, accumulate)
    assert taken is not None, "the Hopper core refused it"
    assert taken[:2] == (kind, slots)
    assert taken[2:5] == ((m if a_t else 0), n, (0 if a_t else k))
    assert taken[5] is None, taken[5]


@pytest.mark.parametrize("args, why", [
    ((64, 64, 64, 64, 64, 64, True, True, "bf16", "bf16", False), "A^T B^T"),
    ((64, 64, 64, 64, 64, 64, False, True, "fp16", "fp16", False), "fp16 operands"),
    ((64, 64, 60, 64, 64, 64, False, True, "bf16", "bf16", False), "k not a multiple of 8"),
    ((64, 61, 64, 64, 64, 64, False, False, "bf16", "fp32", False), "N-major B of 61 columns"),
    ((64, 64, 64, 60, 64, 64, False, True, "bf16", "bf16", False), "row stride of 120 bytes"),
    ((0, 64, 64, 64, 64, 64, False, True, "bf16", "bf16", False), "no rows"),
])
def test_sm90_core_refuses_what_tma_cannot_address(args, why):
    assert H.gemm_sm90_dense(*args) is None, why
    assert H.gemm_sm90_dense(64, 64, 64, 64, 64, 64, False, True, "bf16", "bf16", False, misaligned=True) is None


def test_sm90_core_check_on_the_moe_calls():
    """The expert GEMMs as moe_cuda_torch.cpp fills them pass; a grouped weight gradient without the
    zero buffer, a stride TMA cannot take or C without beta do not."""
    rows = dict(kind="rows_k_major_b", grouped=True, experts=128, slots=131072, m=0, n=1536, k=2048, lda=2048,
                ldb=2048, b_expert_stride=1536 * 2048, ldd=1536, d_expert_stride=0, d_dtype="bf16",
                accumulate=False, zeros=False)
    assert H.gemm_sm90_error(**rows) is None
    assert H.gemm_sm90_error(**{**rows, "accumulate": True}) is None
    assert "row stride" in H.gemm_sm90_error(**{**rows, "ldb": 2044})
    assert "dense" in H.gemm_sm90_error(**{**rows, "grouped": False})
    grad = dict(rows, kind="weight_grad", m=1536, n=2048, k=0, lda=1536, b_expert_stride=0, ldd=2048,
                d_expert_stride=1536 * 2048, zeros=True)
    assert H.gemm_sm90_error(**grad) is None
    assert "zero buffer" in H.gemm_sm90_error(**{**grad, "zeros": False})
    assert H.gemm_sm90_error(**{**grad, "grouped": False, "experts": 1, "zeros": False}) is None
    assert "K >= 1" in H.gemm_sm90_error(**{**grad, "grouped": False, "experts": 1, "slots": 0})


def test_sm90_extra_k_check_on_the_moe_lora_calls():
    """The MoE experts' LoRA as extra K (moe_cuda_torch.cpp): forward x W_e^T + u B_e^T (K-major,
    u [slots, r8], B_e [out, r8]) and grad_x dy W_e + v A_e (N-major, A_e [r8, in]) pass; what TMA
    or the kernels (bf16 D, 16-byte extents) cannot take is refused."""
    forward = dict(kind="rows_k_major_b", n=1536, k=2048, k2=16, lda2=16, ldb2=16, b2_expert_stride=1536 * 16)
    grad_x = dict(kind="rows_n_major_b", n=2048, k=1536, k2=16, lda2=16, ldb2=2048, b2_expert_stride=16 * 2048)
    assert H.gemm_sm90_extra_k_error(**forward) is None and H.gemm_sm90_extra_k_error(**grad_x) is None
    assert "bf16 D" in H.gemm_sm90_extra_k_error(**forward, d_dtype="fp32")
    assert "1 <= k2" in H.gemm_sm90_extra_k_error(**{**forward, "k2": 0})
    assert "16 bytes" in H.gemm_sm90_extra_k_error(**{**forward, "lda2": 12})
    assert "16 bytes" in H.gemm_sm90_extra_k_error(**{**forward, "b2_expert_stride": 1536 * 16 + 4})
    assert "16-byte aligned" in H.gemm_sm90_extra_k_error(**forward, misaligned=True)
    assert "contiguous extents" in H.gemm_sm90_extra_k_error(**{**forward, "k2": 12, "lda2": 16})


@pytest.mark.parametrize("block_k", [64, 128])  # the tiles' K; 128: any other K tile
def test_sm90_extra_k_groups(block_k):
    """Each expert's second pair starts at its first slot (A2) and its own B2_e, and K covers both
    pairs in whole k tiles: the mainloop takes ceil(k / block_k) tiles from the first pair, then the
    second's. An expert without slots starts where the next one does."""
    offsets, slots, k, k2, lda2, b2_stride = [0, 5, 5, 300, 301], 301, 2048 + 8, 16, 16, 1536 * 16
    groups = H.gemm_sm90_extra_k_groups(offsets, slots, k, k2, lda2, b2_stride, block_k)
    assert [a2 for a2, _, _ in groups] == [offsets[e] * lda2 for e in range(4)]
    assert [b2 for _, b2, _ in groups] == [e * b2_stride for e in range(4)]
    assert {total for _, _, total in groups} == {math.ceil(k / block_k) * block_k + block_k}
    assert H.gemm_sm90_extra_k_groups([0, 8], 8, 2048, 130, 136, 0, 64)[0][2] == 2048 + 192


def measured_tile(mean_m: int, n: int) -> str:
    """The H100 sweep's rule (benchmarks/results/h100.md, 2026-11-27): 128x256 from 65 rows per group
    and 129 columns up (Mixtral's 128 rows per expert at T 512 ran 1.28x faster on it), else 128x128."""
    return "128x128" if mean_m <= 64 or n <= 128 else "128x256"


@pytest.mark.parametrize(("kind", "experts", "slots", "m", "n"), [
    ("rows", 128, 4096, 0, 1536),      # Qwen3-30B-A3B gate_up at T 512: 32 rows per expert
    ("rows", 128, 8192, 0, 1536),      # ... at T 1024: 64 rows per expert, the boundary
    ("rows", 128, 8320, 0, 1536),      # 65
    ("rows", 128, 131072, 0, 1536),    # ... at T 16384: 1024 rows per expert
    ("rows", 128, 131072, 0, 128),     # 128 columns: small
    ("rows", 8, 1024, 0, 14336),       # Mixtral at T 512: 128 rows per expert
    ("rows", 8, 8192, 0, 129),         # 129 columns
    ("rows", 1, 8192, 0, 16),          # LoRA's dense u B^T-like product: one group, 16 columns
    ("weight_grad", 128, 4096, 1536, 2048),
    ("weight_grad", 128, 4096, 16, 2048),  # a LoRA A gradient: 16 rows
])
def test_sm90_tile_choice(kind, experts, slots, m, n):
    """Unset, empty or `auto` PYKERNELS_SM90_TILE runs the measured rule on the mean group (a rows
    GEMM's slots per expert, a weight gradient's m); a tile's name runs that tile on every call;
    anything else (the removed 64x128 too) is refused naming the choices."""
    args = dict(kind=kind, experts=experts, slots=slots, m=m, n=n)
    mean_m = m if kind == "weight_grad" else slots // experts
    want = measured_tile(mean_m, n)
    assert H.gemm_sm90_tile(None, **args) == H.gemm_sm90_tile("", **args) == H.gemm_sm90_tile("auto", **args) == want
    assert H.gemm_sm90_tiles == ["128x128", "128x256"]
    for tile in H.gemm_sm90_tiles:
        assert H.gemm_sm90_tile(tile, **args) == tile
    for refused in ("256x128", "64x128"):
        with pytest.raises(ValueError, match=r"auto \(the default: by shape\), 128x128 or 128x256"):
            H.gemm_sm90_tile(refused, **args)


def test_sm90_tile_order_choice():
    """PYKERNELS_SM90_RASTER (common/sm90_tile_order.h): unset or empty walks down M unswizzled (CUTLASS's
    grouped default); m or n with a swizzle of 1, 2, 4 or 8 by name; anything else is refused naming
    the choices."""
    assert H.gemm_sm90_tile_order(None) == H.gemm_sm90_tile_order("") == ("m", 1)
    assert H.gemm_sm90_tile_orders == ["m1", "m2", "m4", "m8", "n1", "n2", "n4", "n8"]
    for name in H.gemm_sm90_tile_orders:
        assert H.gemm_sm90_tile_order(name) == (name[0], int(name[1]))
    for refused in ("m3", "n16", "M8", "8", "n"):
        with pytest.raises(ValueError, match=r"m1 \(the default\), m2, m4, m8, n1, n2, n4 or n8"):
            H.gemm_sm90_tile_order(refused)


def test_sm90_dense_kernel_choice():
    """PYKERNELS_SM90_DENSE (common/sm90_dense_plain.h): the ptr-array kernel unless plain is named; anything
    else is refused naming the choices. The sweep times each (plain also walking along N), the default first."""
    from benchmarks.tile_sweep import DENSES

    assert [H.gemm_sm90_dense_kernel(s) for s in (None, "", "array", "plain")] == ["array", "array", "array", "plain"]
    for choice in DENSES:  # "value@order": the knob's value walking the core's tiles in that order
        value, _, order = choice.partition("@")
        assert H.gemm_sm90_dense_kernel(value) == value and order in ("", *H.gemm_sm90_tile_orders)
    assert DENSES[0] == "array"
    for refused in ("Plain", "cublas", "grouped"):
        with pytest.raises(ValueError, match=r"PYKERNELS_SM90_DENSE must be array \(the default\) or plain"):
            H.gemm_sm90_dense_kernel(refused)


def test_the_plain_kernel_takes_the_lora_forwards_gemm_alone():
    """The plain kernel is built for x W^T with extra K and bf16 D on the 128x256 tile (the LoRA forward); every
    other GEMM the core runs stays on the ptr-array kernel even when plain is asked for."""
    x_w_t = {"a_transposed": False, "b_transposed": True, "d_dtype": "bf16", "tile": "128x256", "extra_k": True}
    assert H.gemm_sm90_plain_takes(**x_w_t)
    others = [{"extra_k": False}, {"b_transposed": False}, {"a_transposed": True, "b_transposed": False},
              {"d_dtype": "fp32"}, {"tile": "128x128"}, {"grouped": True}, {"gated": True}, {"gathered": True}]
    for other in others:
        assert not H.gemm_sm90_plain_takes(**{**x_w_t, **other}), other


@FAST
@given(offsets=st.lists(st.integers(-5, 60), min_size=2, max_size=12), slots=st.integers(0, 50))
def test_sm90_groups_with_malformed_offsets_stay_in_bounds(offsets, slots):
    """Negative, decreasing or too large offsets: every group still addresses only its operands'
    memory (run_groups checks each address; overlapping groups may write one row twice)."""
    experts, n, k = len(offsets) - 1, 8, 8
    for kind in ("rows", "weight_grad"):
        for gm, gn, gk, a_off, b_off, d_off, use_zeros in H.gemm_sm90_groups(kind, offsets, slots, 8, n, k, k, n,
                                                                               n * k, n, 8 * n):
            assert min(gm, gn, gk) >= 0
            if kind == "rows":
                assert a_off + gm * k <= slots * k and b_off + n * k <= experts * n * k and d_off + gm * n <= slots * n
            else:
                assert use_zeros or (a_off + gk * 8 <= slots * 8 and b_off + gk * n <= slots * n)
                assert gk >= 1 and d_off + 8 * n <= experts * 8 * n


# ------------------------------------------------------------------ MoE: gather / scatter indices
def stable_sort_routing(ids: list[int], experts: int) -> tuple[list[int], list[int]]:
    """sorted_token_idx and expert_offsets of moe.sort_tokens, by Python's stable sort."""
    bucket = [i if 0 <= i < experts else experts for i in ids]
    order = sorted(range(len(ids)), key=lambda a: bucket[a])
    offsets = [sum(1 for b in bucket if b < e) for e in range(experts + 1)]
    return order, offsets


@FAST
@given(data=st.data(), tokens=st.integers(1, 40), top_k=st.integers(1, 8), experts=st.integers(1, 70))
def test_routing_maps(data, tokens, top_k, experts):
    ids = data.draw(st.lists(st.integers(-2, experts + 1), min_size=tokens * top_k, max_size=tokens * top_k))
    assert [H.moe_expert_bucket(i, experts) for i in ids] == [i if 0 <= i < experts else experts for i in ids]
    order, offsets = stable_sort_routing(ids, experts)
    token_of_slot, k_slot_of_slot, slot_of_assignment = H.moe_routing_maps(order, offsets, top_k)
    assert token_of_slot == [a // top_k for a in order]
    assert k_slot_of_slot == [a % top_k for a in order]
    kept = offsets[experts]
    assert slot_of_assignment == [s if s < kept else -1 for s in sorted(range(len(order)), key=order.__getitem__)]
    for s, a in enumerate(order):
        assert H.moe_assignment_of(token_of_slot[s], k_slot_of_slot[s], top_k) == a


def test_routing_maps_out_of_range_entries():
    """Malformed sorted_token_idx entries get token -1 and write no slot_of_assignment entry."""
    token_of_slot, k_slot_of_slot, slot_of_assignment = H.moe_routing_maps([3, -1, 5, 0, 2], [0, 2, 4], 2)
    assert token_of_slot == [1, -1, -1, 0, 1]
    assert k_slot_of_slot == [1, -1, -1, 0, 0]
    assert slot_of_assignment == [3, -2, -1, 0, -2]  # slot 4 is dropped (>= offsets[E]); -2: never written


@pytest.mark.parametrize("rows", [0, 1, 7])
def test_slot_row_index(rows):
    for s in range(9):
        assert H.moe_slot_row_index(None, s, rows) == (s if s < rows else -1)
    row_map = [-3, -1, 0, 1, 6, 7, 8, 1 << 40, 2]
    for s, row in enumerate(row_map):
        assert H.moe_slot_row_index(row_map, s, rows) == (row if 0 <= row < rows else -1)


# ------------------------------------------------------------------ logprobs: vocab chunks
VOCABS = [1, 2, 7, 8191, 8192, 8193, 32001, 50257, 65537, 131071, 151936]  # primes, GPT-2, Llama, Qwen


def chunk_sizes(vocab: int) -> list[int]:
    return sorted({H.logprobs_vocab_chunk, 1000, 4093, 7, vocab, vocab + 1} | ({1} if vocab < 10000 else set()))


@pytest.mark.parametrize("vocab", VOCABS)
def test_vocab_chunks(vocab):
    assert H.logprobs_vocab_chunk == 8192 and H.logprobs_token_chunk == 4096
    for chunk in chunk_sizes(vocab):
        chunks = [tuple(c) for c in H.logprobs_chunks(vocab, chunk)]
        assert chunks == [(b, min(chunk, vocab - b)) for b in range(0, vocab, chunk)]
        assert all(size >= 1 for _, size in chunks) and sum(size for _, size in chunks) == vocab
        assert chunks[-1][1] == vocab - chunk * (len(chunks) - 1)
        targets = sorted({-100, -1, 0, 1, chunk - 1, chunk, chunk + 1, vocab - 2, vocab - 1, vocab, vocab + 1,
                          random.Random(vocab).randrange(vocab)})
        claims = [tuple(c) for c in H.logprobs_target_claims(targets, vocab, chunk)]
        assert claims == [(1, t) if 0 <= t < vocab else (0, -1) for t in targets], "each target in one chunk"
        for t in targets:
            assert H.logprobs_target_out_of_vocab(t, -100, vocab) == (t != -100 and not 0 <= t < vocab)
    assert H.logprobs_chunks(0, 8192) == []


@FAST
@given(target=st.integers(-10**6, 10**6), v0=st.integers(0, 10**6), cols=st.integers(1, 10**5))
def test_target_column(target, v0, cols):
    expected = target - v0 if v0 <= target < v0 + cols else -1
    assert H.logprobs_target_column(target, v0, cols) == expected


def test_padded_row_length():
    for cols in list(range(0, 70)) + [8191, 8192, 8193, 32001, 50257, 151936]:
        padded = H.logprobs_padded_row_length(cols)
        assert padded % 8 == 0 and cols <= padded < cols + 8


# ------------------------------------------------------------------ NF4: layout and scale decode
@pytest.mark.parametrize("blocksize", [32, 64, 128, 4096])
def test_nf4_element_location(blocksize):
    for i in list(range(0, 300)) + [blocksize * k + d for k in (1, 2, 255, 256, 257) for d in (-1, 0, 1)]:
        assert H.nf4_packed_byte_of(i) == i // 2
        assert H.nf4_block_of(i, blocksize) == i // blocksize
    for numel in (1, 2, 7, 83, blocksize - 1, blocksize, blocksize + 1, 5125):
        assert H.nf4_packed_bytes(numel) == math.ceil(numel / 2)
        blocks = math.ceil(numel / blocksize)
        partial = [H.nf4_block_is_partial(b, blocksize, numel) for b in range(blocks)]
        assert partial == [b == blocks - 1 and numel % blocksize != 0 for b in range(blocks)]
    for block in (0, 1, 255, 256, 257, 511, 512, 100000):
        assert H.nf4_nested_block_of(block, 256) == block // 256


@pytest.mark.parametrize("numel", [1, 2, 7, 16, 83, 769])
def test_nf4_nibbles_high_first(numel):
    rng = random.Random(numel)
    packed = [rng.randrange(256) for _ in range(math.ceil(numel / 2))]
    expected = [nibble for byte in packed for nibble in (byte >> 4, byte & 0x0F)][:numel]
    assert H.nf4_unpack_codes(packed, numel) == expected
    assert [H.nf4_code_of_element(packed[i // 2], i) for i in range(numel)] == expected


def test_nf4_pack_word_is_bitsandbytes_byte_order():
    rng = random.Random(1)
    for codes in [list(range(8)), list(range(8, 16)), [15] * 8, [0] * 8] + [
            [rng.randrange(16) for _ in range(8)] for _ in range(50)]:
        word = H.nf4_pack_word(codes)
        assert list(word.to_bytes(4, "little")) == [codes[2 * k] << 4 | codes[2 * k + 1] for k in range(4)]
        assert H.nf4_unpack_codes(list(word.to_bytes(4, "little")), 8) == codes


F32_EDGES = [0.0, -0.0, 1.0, -1.0, 1e-38, 1e-45, 3.0e38, -3.0e38, 0.1, 7.9e-3, 2.0**-126, 65504.0, 1.0 / 3.0]


def same_f32(actual: float, expected: np.float32) -> bool:
    return bool(np.isnan(expected)) if math.isnan(actual) else np.float32(actual).tobytes() == expected.tobytes()


def test_nf4_absmax_decode_rounds_twice_in_fp32():
    """code * nested_absmax rounded to fp32, then + offset rounded to fp32: bitsandbytes'
    dequantize_blockwise(absmax_q) + offset. numpy float32 arithmetic is the oracle."""
    rng = random.Random(2)
    values = F32_EDGES + [rng.uniform(-1, 1) * 10.0 ** rng.randint(-40, 38) for _ in range(300)]
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        for _ in range(2000):
            code, nested, offset = (np.float32(rng.choice(values)) for _ in range(3))
            expected = np.float32(np.float32(code * nested) + offset)
            assert same_f32(H.nf4_decode_absmax(code, nested, offset), expected)
            assert same_f32(H.nf4_dequantize_value(code, nested), np.float32(code * nested))


@pytest.mark.parametrize("numel, blocksize", [(83, 64), (769, 32), (40_001, 32)])  # 40001 / 32: 5 nested blocks
def test_nf4_double_quant_dequantize_matches_bitsandbytes(numel, blocksize):
    """The dequantize kernel's element -> (byte, nibble, block, nested block) walk and scale decode,
    composed on the host, against bitsandbytes' own double-quantized dequantization (bit-exact)."""
    import bnb_oracle
    import torch

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.linspace(0.01, 30, numel)
    packed, state = bnb_oracle.quantize(x, blocksize, double_quant=True)
    ours = H.nf4_dequantize_double_quant(packed.tolist(), numel, blocksize, state.absmax.tolist(),
                                         state.state2.code.tolist(), state.state2.absmax.tolist(),
                                         float(state.offset), state.state2.blocksize)
    expected = bnb_oracle.dequantize(packed, state, torch.float32)
    assert torch.equal(torch.tensor(ours, dtype=torch.float32), expected)


@pytest.mark.parametrize("numel", [2048, 3 * 1024 + 77, 40_001])  # whole chunks only; a partial last; 39 + 1
@pytest.mark.parametrize("blocksize", [32, 64, 256, 1024, 4096])
@pytest.mark.parametrize("unit_values", [8, 4])  # 16-bit out, fp32 out
def test_nf4_warp_chunk_dequantize_matches_bitsandbytes(numel, blocksize, unit_values):
    """PYKERNELS_NF4_DEQUANT=warps: the warp kernel's staging of codes (16-byte loads in lane order),
    its per-lane block scales and the shuffle each store unit takes its scale by, composed on the host
    from the same helpers (nf4_layout.h), write every value once and give bitsandbytes' values."""
    import bnb_oracle
    import torch

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + blocksize)) * torch.linspace(0.01, 9, numel)
    packed, state = bnb_oracle.quantize(x, blocksize, double_quant=False)
    ours = H.nf4_dequantize_warps(packed.tolist(), numel, blocksize, state.absmax.tolist(), unit_values)
    expected = bnb_oracle.dequantize(packed, state, torch.float32)
    assert torch.equal(torch.tensor(ours, dtype=torch.float32), expected)


def test_nf4_warp_chunk_stores_cover_512_contiguous_bytes_per_instruction():
    """Store u of the 32 lanes covers one run of 32 units: 512 contiguous bytes (8 bf16 or 4 fp32 values
    a unit), what makes each 16-byte store instruction whole sectors."""
    for unit_values in (8, 4):
        for u in range(1024 // (32 * unit_values)):
            starts = [H.nf4_warp_unit_offset(u, lane, unit_values) for lane in range(32)]
            assert starts == [starts[0] + lane * unit_values for lane in range(32)]
            assert starts[0] == u * 32 * unit_values


def test_nf4_dequantize_kernel_knob():
    assert H.nf4_dequantize_kernel(None) == H.nf4_dequantize_kernel("") == H.nf4_dequantize_kernel("warps") == "warps"
    assert H.nf4_dequantize_kernel("units") == "units"
    with pytest.raises(ValueError, match=r"PYKERNELS_NF4_DEQUANT must be warps \(the default\) or units"):
        H.nf4_dequantize_kernel("warp")


# ------------------------------------------------------------------ online softmax merge
NEG_INF = float("-inf")
EMPTY = (NEG_INF, 0.0, 0.0)


def f32(x: float) -> float:
    return float(np.float32(x))


def partial_fp64(z: list[float]) -> tuple[float, float, float]:
    """(max, sum exp(z - max), sum exp(z - max) (z - max)) in fp64; -inf logits contribute nothing."""
    finite = [v for v in z if v != NEG_INF]
    if not finite:
        return EMPTY
    m = max(finite)
    return m, math.fsum(math.exp(v - m) for v in finite), math.fsum(math.exp(v - m) * (v - m) for v in finite)


def lse_entropy_fp64(z: list[float]) -> tuple[float, float]:
    m, s, sz = partial_fp64(z)
    return m + math.log(s), math.log(s) - sz / s


def logits(rng: random.Random, n: int, scale: float, shift: float, p_neg_inf: float) -> list[float]:
    return [NEG_INF if rng.random() < p_neg_inf else f32(shift + scale * rng.gauss(0, 1)) for _ in range(n)]


def assert_close_to_fp64(partial, z: list[float]) -> None:
    lse, entropy = H.softmax_summarize(partial)
    lse64, entropy64 = lse_entropy_fp64(z)
    assert math.isclose(lse, lse64, rel_tol=2e-6, abs_tol=2e-5), (lse, lse64)
    assert math.isclose(entropy, entropy64, rel_tol=1e-4, abs_tol=1e-4), (entropy, entropy64)


CASES = [  # (n, scale, shift, fraction of -inf logits)
    (1, 1.0, 0.0, 0.0), (7, 1.0, 0.0, 0.0), (769, 3.0, 0.0, 0.0), (5125, 30.0, -20.0, 0.0),
    (1000, 1.0, 8000.0, 0.0), (1000, 0.01, 0.0, 0.0), (500, 40.0, 0.0, 0.5), (64, 1.0, -1e4, 0.9),
]


@pytest.mark.parametrize("n, scale, shift, p_neg_inf", CASES)
@pytest.mark.parametrize("parts", [1, 2, 7])
def test_softmax_merge_matches_fp64_logsumexp(n, scale, shift, p_neg_inf, parts):
    rng = random.Random(n * 31 + parts)
    z = logits(rng, n, scale, shift, p_neg_inf)
    if all(v == NEG_INF for v in z):
        z[0] = 0.0
    cuts = sorted(rng.randrange(n + 1) for _ in range(parts - 1))
    pieces = [z[a:b] for a, b in zip([0] + cuts, cuts + [n])]  # empty and all -inf pieces included
    partials = [partial_fp64(p) for p in pieces]
    merged = H.softmax_merge_all(partials)
    assert_close_to_fp64(merged, z)
    pairwise = partials[0]
    for p in partials[1:]:
        pairwise = H.softmax_merge(p, pairwise)  # the other order
    assert_close_to_fp64(pairwise, z)


@pytest.mark.parametrize("n, scale, shift, p_neg_inf", CASES)
def test_softmax_fold_chunk_sequence(n, scale, shift, p_neg_inf):
    """The fold kernel's sequence: per chunk, new_max = max(running max, chunk max), the chunk's sums
    taken relative to new_max, folded into stats that start at (-inf, 0, 0)."""
    rng = random.Random(n)
    z = logits(rng, n, scale, shift, p_neg_inf)
    if all(v == NEG_INF for v in z):
        z[-1] = 0.0
    running = EMPTY
    for c0 in range(0, n, 97):
        chunk = [v for v in z[c0:c0 + 97] if v != NEG_INF]
        new_max = max([running[0]] + chunk)
        if new_max == NEG_INF:
            continue  # a chunk of -inf logits before any finite one: nothing to fold
        sum_exp = math.fsum(math.exp(v - new_max) for v in chunk)
        sum_exp_z = math.fsum(math.exp(v - new_max) * (v - new_max) for v in chunk)
        running = H.softmax_fold_chunk(running, new_max, sum_exp, sum_exp_z)
    assert_close_to_fp64(running, z)


def test_softmax_merge_with_empty_partials_is_exact():
    """-inf partials (nothing folded yet) never turn into NaN and leave the other side bit-exact."""
    assert H.softmax_merge(EMPTY, EMPTY) == EMPTY
    for p in [(0.0, 1.0, 0.0), (f32(-1e4), f32(3.7), f32(-0.25)), (f32(88.5), 1.0, 0.0)]:
        assert H.softmax_merge(EMPTY, p) == p
        assert H.softmax_merge(p, EMPTY) == p
    assert H.softmax_fold_chunk(EMPTY, 2.0, 1.0, 0.0) == (2.0, 1.0, 0.0)


SLACKS = [0.0, H.softmax_lazy_max_slack]  # add_logit's: the running max, the lazy reference


@pytest.mark.parametrize("n, scale, shift, p_neg_inf", CASES)
@pytest.mark.parametrize("order", ["as drawn", "ascending", "descending"])
@pytest.mark.parametrize("slack", SLACKS)
def test_softmax_add_logits_matches_fp64(n, scale, shift, p_neg_inf, order, slack):
    """add_logit, the Hopper epilogue's per-logit step: ascending logits take the re-base branch every
    time (slack 0) or at every jump past the reference (the lazy one), descending ones never; -inf
    logits (also before any finite one) add nothing, never NaN."""
    rng = random.Random(n + 7)
    z = logits(rng, n, scale, shift, p_neg_inf)
    if all(v == NEG_INF for v in z):
        z[-1] = 0.0
    z = {"as drawn": z, "ascending": sorted(z), "descending": sorted(z, reverse=True)}[order]
    partial = H.softmax_add_logits(z, slack)
    assert_close_to_fp64(partial, z)
    finite = [v for v in z if v != NEG_INF]
    assert max(finite) - slack <= partial[0] <= max(finite)  # the reference trails the max by <= slack


@pytest.mark.parametrize("slack", SLACKS)
def test_softmax_add_logit_edge_values(slack):
    assert H.softmax_add_logits([], slack) == EMPTY
    assert H.softmax_add_logits([NEG_INF, NEG_INF], slack) == EMPTY
    assert H.softmax_add_logits([NEG_INF, 2.0, NEG_INF], slack) == (2.0, 1.0, 0.0)
    assert math.isnan(H.softmax_add_logits([1.0, float("nan"), 0.5], slack)[1])  # a NaN logit is not hidden
    assert H.softmax_add_logits([0.0, float("inf")], slack)[:2] == (float("inf"), 1.0)


def test_the_lazy_reference_moves_only_past_its_slack():
    """Under the lazy reference a logit within the slack above it is summed relative to it (exp > 1);
    one past the slack re-bases, as every new max does with slack 0."""
    slack = H.softmax_lazy_max_slack
    within, past = slack - 1.0, slack + 1.0
    assert H.softmax_add_logits([0.0, within], 0.0) == (within, pytest.approx(1.0 + math.exp(-within)),
                                                         pytest.approx(-within * math.exp(-within)))
    ref, sum_exp, sum_exp_z = H.softmax_add_logits([0.0, within], slack)
    assert ref == 0.0 and sum_exp == pytest.approx(1.0 + math.exp(within), rel=1e-6)
    assert sum_exp_z == pytest.approx(within * math.exp(within), rel=1e-6)
    assert H.softmax_add_logits([0.0, past], slack)[0] == past


# ------------------------------------------------------------------ Hopper logprobs (logprobs_sm90.h)
@pytest.mark.parametrize("tokens, cols", [(1, 1), (3, 127), (2, 128), (5, 129), (130, 300), (4, 1000), (260, 3)])
@pytest.mark.parametrize("scale, shift", [(1.0, 0.0), (30.0, -20.0), (1.0, 8000.0)])
@pytest.mark.parametrize("slack", SLACKS)
def test_sm90_forward_stats_match_fp64(tokens, cols, scale, shift, slack):
    """The Hopper forward's statistics path (per-lane add_logit, the quad's shuffle tree, planes at
    partial_index with rows padded to 256, the fold pass in tile order) gives each row's log-sum-exp
    and entropy: partial last tiles, padding rows and tokens past one GEMM tile (of 128 or 256 rows)
    included."""
    rng = random.Random(tokens * 1000 + cols)
    z = [logits(rng, cols, scale, shift, 0.0) for _ in range(tokens)]
    for row, (lse, entropy) in zip(z, H.logprobs_sm90_stats(z, slack)):
        lse64, entropy64 = lse_entropy_fp64(row)
        assert math.isclose(lse, lse64, rel_tol=2e-6, abs_tol=2e-5), (lse, lse64)
        assert math.isclose(entropy, entropy64, rel_tol=1e-4, abs_tol=1e-4), (entropy, entropy64)


def test_sm90_logprobs_tile_choice():
    """PYKERNELS_SM90_LOGPROBS_TILE: unset or empty runs the measured default; every tile by name (each
    128 vocabulary entries wide, at most kSm90RowPad tokens tall: the partial planes hold any);
    anything else is refused naming the choices."""
    assert H.logprobs_sm90_tile(None) == H.logprobs_sm90_tile("") == "256x128"
    assert H.logprobs_sm90_tiles == ["256x128", "128x128"]  # the default first
    for tile in H.logprobs_sm90_tiles:
        assert H.logprobs_sm90_tile(tile) == tile
    assert H.logprobs_sm90_row_pad % 256 == 0
    for bad in ("128x256", "128x128_pingpong", "128X128"):
        with pytest.raises(ValueError, match=r"256x128 \(the default\) or 128x128"):
            H.logprobs_sm90_tile(bad)


def test_sm90_logprobs_fold_choice():
    """PYKERNELS_SM90_LOGPROBS_FOLD: the running max unless lazy_max is named; anything else refused."""
    for default in (None, "", "running_max"):
        assert H.logprobs_sm90_fold(default) == "running_max"
    assert H.logprobs_sm90_fold("lazy_max") == "lazy_max"
    with pytest.raises(ValueError, match=r"running_max \(the default\) or lazy_max"):
        H.logprobs_sm90_fold("lazy")


@pytest.mark.parametrize("g_lp, g_ent", [(1.0, 0.0), (0.0, 1.0), (-0.7, 2.5), (0.0, 0.0)])
def test_logit_grad_matches_autograd(g_lp, g_ent):
    """logit_grad, the per-logit formula of the sm80 grad kernel, the Hopper epilogue (target=False)
    and the target fix-up (target=True), against autograd of g_lp logprob + g_ent entropy in fp64."""
    import torch

    z = torch.randn(37, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).mul_(4).requires_grad_()
    target = 11
    logp = torch.log_softmax(z, 0)
    entropy = -(logp.exp() * logp).sum()
    (g_lp * logp[target] + g_ent * entropy).backward()
    lse = torch.logsumexp(z, 0).item()
    shift = entropy.item() - lse
    ours = [H.logprobs_logit_grad(f32(v), f32(lse), f32(shift), g_lp, g_ent, i == target)
            for i, v in enumerate(z.tolist())]
    torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), z.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("args, why", [
    (dict(tokens=0, rows=5, h=64), "lie in [1, 2^31)"),
    (dict(tokens=5, rows=2**31, h=64), "lie in [1, 2^31)"),
    (dict(tokens=5, rows=5, h=60), "multiple of 8"),
    (dict(tokens=5, rows=5, h=64, hidden=8), "16-byte aligned"),
    (dict(tokens=5, rows=5, h=64, weight=24), "16-byte aligned"),
    (dict(tokens=5, rows=9, h=64, ld=8, dz=16), "cover the rows"),
    (dict(tokens=5, rows=9, h=64, ld=20, dz=16), "multiple of 8"),
    (dict(tokens=5, rows=9, h=64, ld=16, dz=8), "dz must be 16-byte aligned"),
])
def test_sm90_logprobs_refuse_what_tma_cannot_address(args, why):
    assert why in H.logprobs_sm90_error(**args)


def test_sm90_logprobs_accept_the_shapes_the_op_makes():
    for tokens, rows, h, ld in [(1, 1, 8, 0), (4096, 65536, 4096, 0), (4096, 8192, 4096, 8192), (7, 13, 24, 16)]:
        assert H.logprobs_sm90_error(tokens, rows, h, hidden=256, weight=512, ld=ld, dz=1024) == ""


# ------------------------------------------------------------------ LoRA: the rank GEMM's split-k plan
def rank_tile_oracle(m: int, n: int) -> tuple[int, int]:
    return (128, 16) if n <= 16 else (16, 128) if m <= 16 else (64, 64)


@given(m=st.integers(1, 70000), n=st.integers(1, 20000), k=st.integers(0, 70000),
       sms=st.sampled_from([0, 1, 8, 108, 132]))
@FAST
def test_rank_gemm_splits_cover_k_once(m, n, k, sms):
    """The kernel's CTA z sums k in [z k_per_split, min(k, (z + 1) k_per_split)): the ranges must
    tile [0, k) without overlap or an empty one (the reduce adds every plane), in 16-deep slices."""
    tile_m, tile_n, splits, k_per_split, floats = H.lora_rank_gemm_plan(m, n, k, sms)
    assert (tile_m, tile_n) == rank_tile_oracle(m, n)
    assert 1 <= splits <= 64
    if splits == 1:
        assert (k_per_split, floats) == (k, 0)
        return
    assert k_per_split % 16 == 0 and k_per_split >= 512
    ranges = [(z * k_per_split, min(k, (z + 1) * k_per_split)) for z in range(splits)]
    assert ranges[0][0] == 0 and ranges[-1][1] == k
    assert all(begin < end for begin, end in ranges)
    assert all(ranges[z][1] == ranges[z + 1][0] for z in range(splits - 1))
    assert floats == splits * m * n


@pytest.mark.parametrize("m, n, k, name", [
    (8192, 16, 14336, "dxa = dy B"), (8192, 16, 4096, "xa = x A^T"), (14336, 16, 8192, "dB = dy^T xa"),
    (16, 4096, 8192, "dA = dxa^T x")])
def test_rank_gemm_fills_an_h100(m, n, k, name):
    """The LoRA products at T 8192 on a 4096 x 14336 weight, r 16 (the kernel breakdown on an H100
    measured 64 CTAs for dy B at 1.5 TFLOP/s): at least 4 CTAs per SM of 132 once k allows."""
    tile_m, tile_n, splits, _, _ = H.lora_rank_gemm_plan(m, n, k, 132)
    tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
    assert tiles * splits >= 4 * 132 or splits == k // 512, name


def rank_thread_fragments(tile_m: int, tile_n: int, thread: int) -> tuple[list[int], list[int]]:
    """The rows and columns of its tile that rank_gemm_kernel's thread accumulates."""
    tx, ty = H.lora_rank_thread(tile_m, thread)
    return ([H.lora_rank_fragment_index(tile_m, ty, i) for i in range(tile_m // 16)],
            [H.lora_rank_fragment_index(tile_n, tx, j) for j in range(tile_n // 16)])


@pytest.mark.parametrize("tile_m, tile_n", sorted({rank_tile_oracle(m, n) for m in (8, 4096) for n in (8, 4096)}))
def test_rank_gemm_threads_cover_their_tile_once_with_16_byte_shared_loads(tile_m, tile_n):
    """Every (row, column) of the tile is one thread's; a thread that reads more than one value of a
    k-row of a shared slice reads groups of 4 adjacent floats at 16-byte aligned offsets (one
    ld.shared.v4 each, test_ptx checks the instruction); per warp, each load spans at most 256
    contiguous bytes (2 wavefronts), and on the thin tiles the grouped side is 2 addresses (a
    broadcast): 3 loads per 8 FMAs where one load per FMA ran ~15 TFLOP/s on an H100."""
    stride = H.lora_rank_smem_stride
    assert stride(tile_m) * 4 % 16 == 0 and stride(tile_n) * 4 % 16 == 0 and stride(tile_m) >= tile_m
    owned = []
    for thread in range(256):
        rows, cols = rank_thread_fragments(tile_m, tile_n, thread)
        owned += [(r, c) for r in rows for c in cols]
        for values in (rows, cols):
            for g in range(0, len(values) if len(values) > 1 else 0, 4):
                assert values[g] % 4 == 0 and values[g:g + 4] == list(range(values[g], values[g] + 4)), values
    assert sorted(owned) == [(r, c) for r in range(tile_m) for c in range(tile_n)]
    for warp in range(8):
        fragments = [rank_thread_fragments(tile_m, tile_n, 32 * warp + lane) for lane in range(32)]
        for side in (0, 1):
            count = len(fragments[0][side])
            for load in range(0, count, 4 if count > 1 else 1):  # one instruction: a group, or the value
                starts = {f[side][load] for f in fragments}
                width = 4 if count > 1 else 1
                assert max(starts) + width - min(starts) <= 64, (warp, side, sorted(starts))
                if tile_m != tile_n and count > 1:
                    assert len(starts) == 2, (warp, side, sorted(starts))


def test_rank_gemm_small_k_or_no_device_count_is_unsplit():
    assert H.lora_rank_gemm_plan(8192, 16, 1023, 132)[2] == 1  # k < 2 x 512: one range
    assert H.lora_rank_gemm_plan(8192, 16, 14336, 0)[2:] == (1, 14336, 0)  # SM count unknown
    assert H.lora_rank_gemm_plan(64 * 1024, 4096, 16, 132)[2] == 1  # dxa A: k = r


# ------------------------------------------------------------------ tails and alignment
@pytest.mark.parametrize("width", [1, 4, 8, 16])
def test_elements_in_range(width):
    for numel in range(0, 41):
        for first in range(0, 50):
            inside = len([i for i in range(first, first + width) if i < numel])
            assert H.elements_in_range(first, width, numel) == inside
            assert H.whole_vector_in_range(first, width, numel) == (inside == width)


def test_is_aligned_misaligned_starts():
    base = 0x7F00_0000_1000
    for offset in range(0, 70):
        for bytes_ in (1, 2, 4, 8, 16):
            assert H.is_aligned(base + offset, bytes_) == (offset % bytes_ == 0)


def rows_vector_aligned_oracle(address: int, ld: int, extent: int, elements: int, element_bytes: int) -> bool:
    """Every vector access (columns 0, elements, ...) of rows 0..2 is aligned to its size and inside
    its row."""
    width = elements * element_bytes
    return all((address + (r * ld + c) * element_bytes) % width == 0 and c + elements <= extent
               for r in range(3) for c in range(0, extent, elements))


@pytest.mark.parametrize("elements, element_bytes", [(8, 2), (4, 4), (8, 4), (1, 2)])  # lora / moe configs
def test_rows_vector_aligned(elements, element_bytes):
    for start in range(0, 40, element_bytes // 2 or 1):
        address = 0x1000 + start
        for ld in range(1, 21):
            for extent in range(1, ld + 1):
                assert H.rows_vector_aligned(address, ld, extent, elements, element_bytes) == \
                    rows_vector_aligned_oracle(address, ld, extent, elements, element_bytes), (address, ld, extent)
