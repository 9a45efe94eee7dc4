// The Hopper GEMM core on 128x256x64 tiles, cooperative, 2x1 cluster (common/sm90_tiles.h): the
// tile torch._grouped_mm runs large groups on.
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_SM90_TILE_SHAPE Shape<_128, _256, _64>
#define PYKERNELS_SM90_CLUSTER_SHAPE Shape<_2, _1, _1>
#define PYKERNELS_SM90_KERNEL_SCHEDULE cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative
#define PYKERNELS_SM90_EPILOGUE_SCHEDULE cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative
#define PYKERNELS_SM90_TILE_KERNELS kSm90Tile128x256
#include "common/grouped_gemm_sm90_kernels.cuh"
#endif
