// The order in which the Hopper GEMM core's persistent scheduler hands out a group's output tiles
// (CUTLASS's PersistentTileSchedulerSm90Group: raster order and swizzle). Its grouped default walks
// down M with no swizzle: the 132 CTAs in flight cover one or two tile columns, so for one large
// group (the LoRA forward's x W^T at T 8192, 4096 x 14336: 64 x 56 tiles of 128x256) every pair of
// columns reads all of x again (67 MB, more than the 50 MB L2: ~28 passes from HBM). A swizzle of s
// walks s tiles across before going down, so the tiles in flight form a block and both operands are
// re-read from L2 rather than HBM. Which wins is the GPU's to say: PYKERNELS_SM90_RASTER (read on every
// call) picks one, benchmarks/tile_sweep.py times them all. Torch-free; host-tested through
// pykernels._C.host_logic.
#pragma once

#include <cstring>

namespace pykernels::gemm {

struct Sm90TileOrder {
  bool along_n = false;  // walk along N first (CUTLASS RasterOrderOptions::AlongN), else along M
  int swizzle = 1;       // CUTLASS max_swizzle_size: 1, 2, 4 or 8
};

inline constexpr const char* kSm90TileOrders[] = {"m1", "m2", "m4", "m8", "n1", "n2", "n4", "n8"};

// PYKERNELS_SM90_RASTER as `setting` (null or empty: m1, CUTLASS's grouped default): m or n (the
// direction walked first) and the swizzle. Null on success, else a message naming the choices.
inline const char* sm90_tile_order_for(const char* setting, Sm90TileOrder* order) {
  *order = Sm90TileOrder{};
  if (setting == nullptr || setting[0] == '\0') return nullptr;
  for (const char* name : kSm90TileOrders) {
    if (std::strcmp(setting, name) == 0) {
      order->along_n = name[0] == 'n';
      order->swizzle = name[1] - '0';
      return nullptr;
    }
  }
  return "PYKERNELS_SM90_RASTER must be m1 (the default), m2, m4, m8, n1, n2, n4 or n8";
}

}  // namespace pykernels::gemm
