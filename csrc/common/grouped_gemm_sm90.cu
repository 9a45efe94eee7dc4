// The Hopper GEMM core (declarations and the math in grouped_gemm_sm90.h): CUTLASS 3.x ptr-array
// grouped GEMMs, the building block NVIDIA tests for exactly this (example 57; vLLM's and torch's
// grouped MoE GEMMs use it too), which matters while this code rarely meets a GPU. The MoE ops run
// their expert GEMMs on it, the LoRA and logprobs ops their dense GEMMs (one group).
//
// This file checks a call and hands it to its tile's kernels (p.tile, common/sm90_tiles.h): each tile
// is its own file, grouped_gemm_tile_*_sm90.cu, built from grouped_gemm_sm90_kernels.cuh; a dense GEMM
// that asks for CUTLASS's plain kernel and that it takes goes to dense_gemm_plain_sm90.cu
// (common/sm90_dense_plain.h).
//
// Compiled for sm_90a alone (cmake/sm90_sources.cmake); without PYKERNELS_SM90A_GEMM (archs
// without sm_90a) the launcher reports that the kernels are not built.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/grouped_gemm_sm90.h"
#include "common/grouped_gemm_sm90_tiles.h"
#include "common/sm90_dense_plain.h"

namespace pykernels::gemm {

const char* sm90_failure(std::string message) {
  thread_local std::string last;
  last = "grouped GEMM (sm_90a): " + std::move(message);
  return last.c_str();
}

#ifdef PYKERNELS_SM90A_GEMM
namespace {

const Sm90TileKernels& kernels_of(const GroupedGemmSm90Params& p) {
  if (sm90_runs_plain(p)) return kSm90DensePlain;
  switch (p.tile) {
    case Sm90Tile::k128x256: return kSm90Tile128x256;
    default: return kSm90Tile128x128;
  }
}

}  // namespace
#endif  // PYKERNELS_SM90A_GEMM

bool grouped_gemm_sm90_built() {
#ifdef PYKERNELS_SM90A_GEMM
  return true;
#else
  return false;
#endif
}

bool grouped_gemm_sm90_available(int device) {
#ifdef PYKERNELS_SM90A_GEMM
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;  // sm_90a code runs on compute capability 9.0 only
#else
  return false;
#endif
}

int64_t grouped_gemm_sm90_workspace_bytes(const GroupedGemmSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return kernels_of(p).workspace_bytes(p, device);
#else
  return 0;
#endif
}

const char* launch_grouped_gemm_sm90(const GroupedGemmSm90Params& p, void* workspace, int device, cudaStream_t stream) {
#ifdef PYKERNELS_SM90A_GEMM
  if (const char* error = grouped_gemm_sm90_error(p)) return sm90_failure(error);
  if (p.slots == 0 && p.kind != Sm90GemmKind::kWeightGrad) return nullptr;
  return kernels_of(p).launch(p, workspace, device, stream);
#else
  return sm90_failure("not built (the extension's CUDA archs do not include 90a)");
#endif
}

}  // namespace pykernels::gemm
