// The Hopper GEMM core's tile configurations. All of them are compiled into every sm_90a build (one
// file each, common/grouped_gemm_sm90_tile_*_sm90.cu) and one is chosen per call, so a lent GPU can
// time them all on one build (benchmarks/tile_sweep.py) instead of rebuilding per tile (~2 minutes of
// a 15-minute lease each). Torch-free; host-tested through pykernels._C.host_logic.
//
//   128x128   128x128x64, cooperative, 1x1 cluster
//   128x256   128x256x64, cooperative, 2x1 cluster: torch._grouped_mm's sm90 tile for large groups
//
// PYKERNELS_SM90_TILE (read on every call): `auto` (the default, also when unset) picks by shape,
// 128x128 when a group's mean rows are at most 64 or its columns at most 128, else 128x256; a tile's
// name runs that tile. The rule is the H100 sweep's (benchmarks/results/h100.md, 2026-11-27): 128x256
// ran MoE forward+backward 1.04-1.44x faster than 128x128 from 128 rows per expert up (Mixtral T 512
// and 4096, Qwen3-30B-A3B T 4096 and 16384) and 0.91x as fast at Qwen3's 32 rows per expert (T 512).
// A 64x128x128 ping-pong tile (torch._grouped_mm's for small groups) was nowhere faster than 128x128
// (1.00x at 32 rows per expert, 0.84-1.00x elsewhere) and was removed.
#pragma once

#include <cstdint>
#include <cstring>

namespace pykernels::gemm {

// k128x128 first: a value-initialized GroupedGemmSm90Params runs it (every caller sets its tile by
// sm90_tile_for).
enum class Sm90Tile { k128x128, k128x256 };

constexpr Sm90Tile kSm90Tiles[] = {Sm90Tile::k128x128, Sm90Tile::k128x256};

inline const char* sm90_tile_name(Sm90Tile tile) {
  switch (tile) {
    case Sm90Tile::k128x256: return "128x256";
    default: return "128x128";
  }
}

// A tile's CTA columns and the CTAs along M of its cluster (which share each B tile by multicast).
inline int64_t sm90_tile_columns(Sm90Tile tile) { return tile == Sm90Tile::k128x256 ? 256 : 128; }
inline int64_t sm90_tile_cluster_m(Sm90Tile tile) { return tile == Sm90Tile::k128x256 ? 2 : 1; }
inline constexpr int64_t kSm90TileK = 64;  // every tile's k extent

inline constexpr int64_t kSm90SmallGroupRows = 64;     // at most this many mean rows: 128x128
inline constexpr int64_t kSm90NarrowColumns = 128;     // at most this many columns: 128x128

// The default's rule on a group's mean problem: m_per_group is the mean rows of a group (slots /
// groups for a rows GEMM, m for a weight gradient), n its columns. A 256-column tile over at most 128
// columns, or 128 rows over a few dozen, computes mostly padding.
inline Sm90Tile auto_sm90_tile(int64_t m_per_group, int64_t n) {
  return m_per_group <= kSm90SmallGroupRows || n <= kSm90NarrowColumns ? Sm90Tile::k128x128 : Sm90Tile::k128x256;
}

// The tile a call runs on: `setting` is PYKERNELS_SM90_TILE (null or empty: auto). Null on success,
// else a message naming the choices.
inline const char* sm90_tile_for(const char* setting, int64_t m_per_group, int64_t n, Sm90Tile* tile) {
  if (setting == nullptr || setting[0] == '\0' || std::strcmp(setting, "auto") == 0) {
    *tile = auto_sm90_tile(m_per_group, n);
    return nullptr;
  }
  for (const Sm90Tile candidate : kSm90Tiles) {
    if (std::strcmp(setting, sm90_tile_name(candidate)) == 0) {
      *tile = candidate;
      return nullptr;
    }
  }
  return "PYKERNELS_SM90_TILE must be auto (the default: by shape), 128x128 or 128x256";
}

}  // namespace pykernels::gemm
