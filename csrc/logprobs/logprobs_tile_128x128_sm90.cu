// The Hopper lm_head GEMMs of the fused token logprobs on 128x128x64 tiles, 1x1 cluster, cooperative
// (logprobs_sm90.h).
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_LOGPROBS_TILE_SHAPE Shape<_128, _128, _64>
#define PYKERNELS_LOGPROBS_CLUSTER_SHAPE Shape<_1, _1, _1>
#define PYKERNELS_LOGPROBS_TILE_KERNELS kLogprobsTile128x128
#include "logprobs/logprobs_sm90_kernels.cuh"
#endif
