// The Hopper GEMM core's tile configurations. All of them are compiled into every sm_90a build (one
// file each, common/grouped_gemm_sm90_tile_*_sm90.cu) and one is chosen per call, so a lent GPU can
// time them all on one build (benchmarks/tile_sweep.py) instead of rebuilding per tile (~2 minutes of
// a 15-minute lease each). Torch-free; host-tested through pykernels._C.host_logic.
//
//   128x128   128x128x64, cooperative, 1x1 cluster: the default, the one measured on an H100
//             (benchmarks/results/h100.md: MoE 1.16-1.90x torch._grouped_mm, 470-600 TFLOP/s)
//   128x256   128x256x64, cooperative, 2x1 cluster: torch._grouped_mm's sm90 tile for large
//             groups; nearer cuBLAS's 192x192 to 320x128 tiles on 2-CTA clusters (720-810 TFLOP/s)
//   64x128    64x128x128, ping-pong, 2x1 cluster: torch._grouped_mm's sm90 tile for groups of at
//             most 128 rows or columns (Qwen3-30B-A3B at 512 tokens: 32 rows per expert, three
//             quarters of a 128-row tile empty)
//   auto      torch._grouped_mm's rule: 64x128 when a group's mean M or N is at most 128, else
//             128x256. Not the default until a GPU has measured it against 128x128.
//
// PYKERNELS_SM90_TILE (read on every call) picks one; unset means the default.
#pragma once

#include <cstdint>
#include <cstring>

namespace pykernels::gemm {

// k128x128 first: a value-initialized GroupedGemmSm90Params runs the default.
enum class Sm90Tile { k128x128, k128x256, k64x128 };

constexpr Sm90Tile kSm90DefaultTile = Sm90Tile::k128x128;
constexpr Sm90Tile kSm90Tiles[] = {Sm90Tile::k128x128, Sm90Tile::k128x256, Sm90Tile::k64x128};

inline const char* sm90_tile_name(Sm90Tile tile) {
  switch (tile) {
    case Sm90Tile::k128x256: return "128x256";
    case Sm90Tile::k64x128: return "64x128";
    default: return "128x128";
  }
}

// torch._grouped_mm's sm90 rule on a group's mean problem: m_per_group is the mean rows of a group
// (slots / groups for a rows GEMM, m for a weight gradient), n its columns.
inline Sm90Tile auto_sm90_tile(int64_t m_per_group, int64_t n) {
  return m_per_group <= 128 || n <= 128 ? Sm90Tile::k64x128 : Sm90Tile::k128x256;
}

// The tile a call runs on: `setting` is PYKERNELS_SM90_TILE (null or empty: the default). Null on
// success, else a message naming the choices.
inline const char* sm90_tile_for(const char* setting, int64_t m_per_group, int64_t n, Sm90Tile* tile) {
  if (setting == nullptr || setting[0] == '\0') {
    *tile = kSm90DefaultTile;
    return nullptr;
  }
  if (std::strcmp(setting, "auto") == 0) {
    *tile = auto_sm90_tile(m_per_group, n);
    return nullptr;
  }
  for (const Sm90Tile candidate : kSm90Tiles) {
    if (std::strcmp(setting, sm90_tile_name(candidate)) == 0) {
      *tile = candidate;
      return nullptr;
    }
  }
  return "PYKERNELS_SM90_TILE must be 128x128 (the default), 128x256, 64x128 or auto";
}

}  // namespace pykernels::gemm
