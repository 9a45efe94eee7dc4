// The Hopper GEMM core on 128x128x64 tiles, cooperative, 1x1 cluster: the default tile
// (common/sm90_tiles.h), the one an H100 has measured.
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_SM90_TILE_SHAPE Shape<_128, _128, _64>
#define PYKERNELS_SM90_CLUSTER_SHAPE Shape<_1, _1, _1>
#define PYKERNELS_SM90_KERNEL_SCHEDULE cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative
#define PYKERNELS_SM90_EPILOGUE_SCHEDULE cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative
#define PYKERNELS_SM90_TILE_KERNELS kSm90Tile128x128
#include "common/grouped_gemm_sm90_kernels.cuh"
#endif
