// The Hopper lm_head GEMMs of the fused token logprobs on 128x128x64 tiles, 2x1 cluster, under the
// ping-pong schedule: each consumer warpgroup owns a tile, and one's epilogue (the softmax fold, or
// the logit gradient and its store) runs while the other issues wgmma (logprobs_sm90.h).
#ifdef PYKERNELS_SM90A_GEMM
#define PYKERNELS_LOGPROBS_TILE_SHAPE Shape<_128, _128, _64>
#define PYKERNELS_LOGPROBS_CLUSTER_SHAPE Shape<_2, _1, _1>
#define PYKERNELS_LOGPROBS_PINGPONG 1
#define PYKERNELS_LOGPROBS_TILE_KERNELS kLogprobsTile128x128Pingpong
#include "logprobs/logprobs_sm90_kernels.cuh"
#endif
