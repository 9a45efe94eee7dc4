"""The Hopper gated gate_up GEMM's index logic, run on the host (pykernels._C.host_logic): how its B
operand reads an expert's [gate | up] weight in (gate_j, up_j) row pairs through one 3-D TMA box per
CTA (csrc/common/paired_rows.h), and what the launcher refuses (csrc/common/grouped_gemm_sm90.h). The
oracle is the pairing itself, spelled out in Python: row 2j of the tile's logical B is gate row j, row
2j + 1 up row j. The GEMM and its epilogue need a GPU (tests/kernels/moe/test_moe_cuda.py)."""

import pytest

from pykernels import _C

H = _C.host_logic
TILES = {"128x128": (128, 1), "128x256": (256, 2)}  # columns, CTAs along M sharing B (common/sm90_tiles.h)


def expected_weight_row(n: int, inner: int) -> int:
    return inner + n // 2 if n % 2 else n // 2


@pytest.mark.parametrize("n,inner", [(0, 5), (1, 5), (6, 5), (9, 5), (2 * 767, 768), (2 * 767 + 1, 768)])
def test_paired_row_n_reads_gate_or_up_row_n_over_2(n, inner):
    assert H.gemm_paired_weight_row(n, inner) == expected_weight_row(n, inner)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("inner,k,ldb", [(768, 2048, 2048), (256, 72, 80), (1408, 4096, 4096)])
def test_every_tile_row_is_filled_once_from_its_paired_weight_row(tile, inner, k, ldb):
    """Box by box as TMA would place and fetch it: each CTA part's (k, half, j) box lands on its own
    rows of the tile, the parts together cover the tile's block_n rows once, and logical row n of the
    whole B (tile n_tile's row r: n = n_tile block_n + r) comes from the weight's paired row."""
    block_n, cluster_m = TILES[tile]
    if (inner % (block_n // 2)) != 0:
        pytest.skip("this tile holds no whole pairs of halves here: the launcher refuses it")
    for n_tile in range(2 * inner // block_n):
        rows = H.gemm_paired_rows_tile(inner, k, ldb, block_n, cluster_m, n_tile)
        assert sorted(r for r, _ in rows) == list(range(block_n))
        for tile_row, weight_row in rows:
            assert weight_row == expected_weight_row(n_tile * block_n + tile_row, inner), (n_tile, tile_row)


@pytest.mark.parametrize("tile", TILES)
def test_the_pairing_needs_whole_halves_per_tile(tile):
    block_n, cluster_m = TILES[tile]
    assert H.gemm_paired_rows_error(2 * 768, 2048, 2048, block_n, cluster_m) is None
    for n in (2 * 768 + 2, 2 * (block_n // 2) * 3 + 2, 3, 0):
        assert "whole tiles" in H.gemm_paired_rows_error(n, 2048, 2048, block_n, cluster_m)
    assert "16-byte row strides" in H.gemm_paired_rows_error(2 * 768, 2048, 2047, block_n, cluster_m)
    assert "k <= ldb" in H.gemm_paired_rows_error(2 * 768, 2048, 1024, block_n, cluster_m)


def test_the_launcher_checks_the_gated_gemm():
    """A gated call is a kRowsKMajorB GEMM into bf16 D without C, whose tile holds whole pairs; with or
    without the LoRA term as extra K."""
    assert H.gemm_sm90_gated_error("rows_k_major_b", 2 * 768, 2048, "128x256") is None
    assert H.gemm_sm90_gated_error("rows_k_major_b", 2 * 768, 2048, "128x128", k2=16) is None
    assert H.gemm_sm90_gated_error("rows_k_major_b", 2 * 64, 2048, "128x128") is None
    assert "whole tiles" in H.gemm_sm90_gated_error("rows_k_major_b", 2 * 64, 2048, "128x256")
    assert "kRowsKMajorB" in H.gemm_sm90_gated_error("rows_n_major_b", 2 * 768, 2048, "128x256")
    assert "bf16 D" in H.gemm_sm90_gated_error("rows_k_major_b", 2 * 768, 2048, "128x256", d_dtype="fp32")
    assert "no C" in H.gemm_sm90_gated_error("rows_k_major_b", 2 * 768, 2048, "128x256", accumulate=True)
