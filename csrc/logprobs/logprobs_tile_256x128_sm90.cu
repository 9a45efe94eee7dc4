// The Hopper lm_head GEMMs of the fused token logprobs on 256x128x64 tiles (256 tokens by 128
// vocabulary entries), 2x1 cluster: each vocabulary tile is loaded once by TMA multicast for two
// CTAs of tokens (logprobs_sm90.h).
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_LOGPROBS_TILE_SHAPE Shape<_256, _128, _64>
#define PYKERNELS_LOGPROBS_CLUSTER_SHAPE Shape<_2, _1, _1>
#define PYKERNELS_LOGPROBS_TILE_KERNELS kLogprobsTile256x128
#include "logprobs/logprobs_sm90_kernels.cuh"
#endif
