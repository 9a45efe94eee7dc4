// Between the Hopper GEMM core's dispatcher (grouped_gemm_sm90.cu) and its per-tile files
// (grouped_gemm_tile_*_sm90.cu, each built from grouped_gemm_sm90_kernels.cuh, and the plain dense
// kernel's, dense_gemm_plain_sm90.cu): what each file defines. Only sm_90a builds (PYKERNELS_SM90A_GEMM)
// define them.
#pragma once

#include <cstdint>
#include <string>

#include "common/grouped_gemm_sm90.h"

namespace pykernels::gemm {

struct Sm90TileKernels {
  int64_t (*workspace_bytes)(const GroupedGemmSm90Params& p, int device);
  // nullptr on success, else a message (from sm90_failure)
  const char* (*launch)(const GroupedGemmSm90Params& p, void* workspace, int device, cudaStream_t stream);
};

extern const Sm90TileKernels kSm90Tile128x128;  // grouped_gemm_tile_128x128_sm90.cu
extern const Sm90TileKernels kSm90Tile128x256;  // grouped_gemm_tile_128x256_sm90.cu
extern const Sm90TileKernels kSm90DensePlain;   // dense_gemm_plain_sm90.cu (common/sm90_dense_plain.h)

// "grouped GEMM (sm_90a): " + message, kept until the thread's next failure.
const char* sm90_failure(std::string message);

}  // namespace pykernels::gemm
