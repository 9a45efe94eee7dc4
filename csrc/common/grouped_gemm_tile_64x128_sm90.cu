// The Hopper GEMM core on 64x128x128 tiles, ping-pong, 2x1 cluster (common/sm90_tiles.h): the tile
// torch._grouped_mm runs groups of at most 128 rows or columns on.
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_SM90_TILE_SHAPE Shape<_64, _128, _128>
#define PYKERNELS_SM90_CLUSTER_SHAPE Shape<_2, _1, _1>
#define PYKERNELS_SM90_KERNEL_SCHEDULE cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong
#define PYKERNELS_SM90_EPILOGUE_SCHEDULE cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong
#define PYKERNELS_SM90_TILE_KERNELS kSm90Tile64x128
#include "common/grouped_gemm_sm90_kernels.cuh"
#endif
