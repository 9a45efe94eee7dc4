// The Hopper lm_head GEMMs of the fused token logprobs (what they compute: logprobs_sm90.h): this
// file checks a call and hands it to its tile's kernels (LogitsGemmSm90::tile), each tile its own
// file, logprobs_tile_*_sm90.cu, built from logprobs_sm90_kernels.cuh.
// Compiled for sm_90a alone (cmake/sm90_sources.cmake); elsewhere the launchers say "not built".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "logprobs/logprobs_sm90.h"
#include "logprobs/logprobs_sm90_tiles.h"

namespace pykernels::logprobs {

const char* logprobs_sm90_failure(std::string message) {
  thread_local std::string last;
  last = "token_logprobs (sm_90a): " + std::move(message);
  return last.c_str();
}

#ifdef PYKERNELS_SM90A_GEMM
namespace {

const LogprobsSm90TileKernels& kernels_of(LogprobsSm90Tile tile) {
  switch (tile) {
    case LogprobsSm90Tile::k256x128: return kLogprobsTile256x128;
    case LogprobsSm90Tile::k128x128: return kLogprobsTile128x128;
  }
  return kLogprobsTile256x128;
}

}  // namespace
#endif  // PYKERNELS_SM90A_GEMM

bool logprobs_sm90_built() {
#ifdef PYKERNELS_SM90A_GEMM
  return true;
#else
  return false;
#endif
}

int64_t softmax_partials_sm90_workspace_bytes(const SoftmaxPartialsSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return kernels_of(p.gemm.tile).partials_workspace_bytes(p, device);
#else
  (void)p, (void)device;
  return 0;
#endif
}

int64_t logit_grad_sm90_workspace_bytes(const LogitGradSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return kernels_of(p.gemm.tile).logit_grad_workspace_bytes(p, device);
#else
  (void)p, (void)device;
  return 0;
#endif
}

const char* launch_softmax_partials_sm90(const SoftmaxPartialsSm90Params& p, void* workspace, int device,
                                         cudaStream_t stream) {
#ifdef PYKERNELS_SM90A_GEMM
  if (const char* error = logits_gemm_sm90_error(p.gemm)) return logprobs_sm90_failure(error);
  return kernels_of(p.gemm.tile).launch_partials(p, workspace, device, stream);
#else
  (void)p, (void)workspace, (void)device, (void)stream;
  return logprobs_sm90_failure("not built (the extension's CUDA archs do not include 90a)");
#endif
}

const char* launch_logit_grad_sm90(const LogitGradSm90Params& p, void* workspace, int device, cudaStream_t stream) {
#ifdef PYKERNELS_SM90A_GEMM
  if (const char* error = logit_grad_sm90_error(p)) return logprobs_sm90_failure(error);
  return kernels_of(p.gemm.tile).launch_logit_grad(p, workspace, device, stream);
#else
  (void)p, (void)workspace, (void)device, (void)stream;
  return logprobs_sm90_failure("not built (the extension's CUDA archs do not include 90a)");
#endif
}

}  // namespace pykernels::logprobs
