// Between the Hopper logprobs kernels' dispatcher (logprobs_sm90.cu) and their per-tile files
// (logprobs_tile_*_sm90.cu, each built from logprobs_sm90_kernels.cuh): what each tile's file
// defines. Only sm_90a builds (PYKERNELS_SM90A_GEMM) define them.
#pragma once

#include <cstdint>
#include <string>

#include "logprobs/logprobs_sm90.h"

namespace pykernels::logprobs {

struct LogprobsSm90TileKernels {
  int64_t (*partials_workspace_bytes)(const SoftmaxPartialsSm90Params& p, int device);
  int64_t (*logit_grad_workspace_bytes)(const LogitGradSm90Params& p, int device);
  // nullptr on success, else a message (from logprobs_sm90_failure)
  const char* (*launch_partials)(const SoftmaxPartialsSm90Params& p, void* workspace, int device,
                                 cudaStream_t stream);
  const char* (*launch_logit_grad)(const LogitGradSm90Params& p, void* workspace, int device, cudaStream_t stream);
};

extern const LogprobsSm90TileKernels kLogprobsTile128x128;  // logprobs_tile_128x128_sm90.cu
extern const LogprobsSm90TileKernels kLogprobsTile256x128;  // logprobs_tile_256x128_sm90.cu

// "token_logprobs (sm_90a): " + message, kept until the thread's next failure.
const char* logprobs_sm90_failure(std::string message);

}  // namespace pykernels::logprobs
