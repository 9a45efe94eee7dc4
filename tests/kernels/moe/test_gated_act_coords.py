"""Where the Hopper gated gate_up epilogue (csrc/moe/gated_act_visitor_sm90.cuh) writes act(gate) * up,
checked on the host with CUTLASS's own CuTe code (nvcc compiles it; no GPU): for every thread of a tiled copy
and every one of its epilogue registers, `tile_register_coords` must give the register's (m, n) from the
tile's corner, as the collective epilogue (CUTLASS 4.2's sm90_epilogue_array_tma_warpspecialized.hpp)
computes the absolute coordinates it stores D at, less that corner; and together they must cover the tile
once. The collective's own `tCcD`, which the visitor used until its first GPU run (every fused test wrong
there, D right), counts from each thread's first register instead: the program reports that too, so this
test fails if the visitor goes back to it or a CUTLASS update changes what either means. The tiled copies
are stand-ins of two thread arrangements (the visitor's coordinates depend on the copy only through
CUTLASS's partition); the GPU tests (test_gate_up_act_cuda.py) run the real one."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")

PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "cute/tensor.hpp"
#include "cutlass/numeric_conversion.h"
#include "moe/gated_act_visitor_sm90.cuh"
using namespace cute;

// Every register of every thread: (our coordinate wrong, the collective's tCcD wrong, tile covered once).
template <class TiledCopy, class Tile, class EpiTile>
void check(const char* name, TiledCopy tiled, Tile tile_mnk, EpiTile epi) {
  const int M = 1000, N = 3000, m_tile = 2, n_tile = 3;  // a tile inside a larger problem
  const int tile_m = size<0>(tile_mnk), tile_n = size<1>(tile_mnk);
  int ours_off = 0, tccd_off = 0, registers = 0;
  std::vector<int> seen(tile_m * tile_n, 0);
  for (int t = 0; t < int(size(tiled)); ++t) {
    // the collective's construction (store(): mD_crd, cD_mn, tRS_cD_mn, tRS_cD)
    Tensor mD_crd = make_identity_tensor(make_shape(M, N));
    Tensor cD_mn = local_tile(mD_crd, take<0, 2>(tile_mnk), make_coord(m_tile, n_tile));
    Tensor tRS_cD_mn = tiled.get_thread_slice(t).partition_S(flat_divide(cD_mn, epi));
    Tensor tRS_cD = make_coord_tensor(tRS_cD_mn.layout());
    Tensor ours = pykernels::moe::sm90::tile_register_coords<true>(tile_mnk, epi, tiled, t);
    for (int v = 0; v < int(size(tRS_cD_mn)); ++v, ++registers) {
      const int m = int(get<0>(tRS_cD_mn(v))) - m_tile * tile_m, n = int(get<1>(tRS_cD_mn(v))) - n_tile * tile_n;
      ours_off += int(get<0>(ours(v))) != m || int(get<1>(ours(v))) != n;
      tccd_off += int(get<0>(tRS_cD(v))) != m || int(get<1>(tRS_cD(v))) != n;
      if (m >= 0 && m < tile_m && n >= 0 && n < tile_n) ++seen[m * tile_n + n];
    }
  }
  int covered_once = 1;
  for (int count : seen) covered_once &= count == 1;
  printf("%s registers=%d ours_off=%d tccd_off=%d covered_once=%d\n", name, registers, ours_off, tccd_off,
         covered_once);
}

int main() {
  using Atom = Copy_Atom<UniversalCopy<uint32_t>, half_t>;  // a column pair per copy, as the gated epilogue needs
  auto by_columns = make_tiled_copy(Atom{}, Layout<Shape<_32, _4>>{}, Layout<Shape<_1, _2>>{});
  auto by_rows = make_tiled_copy(Atom{}, Layout<Shape<_8, _16>, Stride<_16, _1>>{}, Layout<Shape<_2, _2>>{});
  check("128x128/columns", by_columns, make_shape(_128{}, _128{}, _64{}), make_shape(_64{}, _32{}));
  check("128x256/columns", by_columns, make_shape(_128{}, _256{}, _64{}), make_shape(_64{}, _32{}));
  check("128x256/rows", by_rows, make_shape(_128{}, _256{}, _64{}), make_shape(_64{}, _32{}));
  check("256x128/rows", by_rows, make_shape(_256{}, _128{}, _64{}), make_shape(_128{}, _64{}));
}
"""


def cutlass_include() -> str:
    """The nvidia-cutlass wheel's headers, as CMake finds them (cmake/dependencies.cmake)."""
    import cutlass_library

    return str(Path(cutlass_library.__file__).parent / "source" / "include")


def test_the_gated_epilogue_writes_each_register_at_its_place_in_the_tile(tmp_path):
    source, program = tmp_path / "coords.cu", tmp_path / "coords"
    source.write_text(PROGRAM)
    includes = [f"-I{ROOT / 'csrc'}", f"-I{cutlass_include()}"]
    subprocess.run([NVCC, "-std=c++17", *includes, str(source), "-o", str(program)], check=True, capture_output=True,
                   text=True, timeout=300)
    lines = subprocess.run([str(program)], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert len(lines) == 4, lines
    for line in lines:
        _, *fields = line.split()
        counts = {key: int(value) for key, value in (field.split("=") for field in fields)}
        assert counts["ours_off"] == 0 and counts["covered_once"] == 1, line
        # the collective's tCcD is right only where a thread's first register sits at the tile's corner
        assert counts["tccd_off"] > counts["registers"] // 2, line
