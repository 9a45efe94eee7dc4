// What every CUTLASS 3.x kernel of the sm_90a files needs around it (common/grouped_gemm_sm90.cu,
// logprobs/logprobs_sm90.cu): strides from a leading dimension, and one launch with CUTLASS's own
// checks. Included only where PYKERNELS_SM90A_GEMM is defined.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace pykernels::gemm {

// A stride whose one dynamic mode (the leading dimension) is ld; the others are CUTLASS's static
// unit stride and batch stride 0.
template <class Stride>
__host__ __device__ Stride leading_stride(int64_t ld) {
  Stride stride{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>::value) {
    cute::get<1>(stride) = ld;
  } else {
    cute::get<0>(stride) = ld;
  }
  return stride;
}

// Runs one CUTLASS device-level GEMM (a GemmUniversalAdapter): its can_implement, initialize with
// workspace, the launch, and the launch's CUDA error. Empty on success, else what failed.
template <class Gemm>
std::string run_cutlass_gemm(const typename Gemm::Arguments& args, void* workspace, cudaStream_t stream) {
  Gemm gemm;
  if (const cutlass::Status s = gemm.can_implement(args); s != cutlass::Status::kSuccess)
    return std::string("CUTLASS cannot run this problem: ") + cutlassGetStatusString(s);
  if (const cutlass::Status s = gemm.initialize(args, workspace, stream); s != cutlass::Status::kSuccess)
    return std::string("CUTLASS initialize failed: ") + cutlassGetStatusString(s);
  if (const cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess)
    return std::string("CUTLASS launch failed: ") + cutlassGetStatusString(s);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess)
    return std::string("kernel launch failed: ") + cudaGetErrorString(error);
  return {};
}

}  // namespace pykernels::gemm
