// The torch side of the Hopper GEMM core (common/grouped_gemm_sm90.h): whether a call may use it,
// and the dense GEMMs of the LoRA and logprobs ops (gemm::GemmParams) run on it as one group, with
// the workspace from torch's caching allocator. Included by *_cuda_torch.cpp files only.
//
// PYKERNELS_SM90=0 in the environment keeps every op on its sm80 kernels (to compare the two on one
// GPU, or to step around a Hopper kernel while the dispatcher's check has not caught it);
// PYKERNELS_SM90_TILE picks the core's tile (common/sm90_tiles.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/env_knob.h"
#include "common/gemm_sm90_dense.h"
#include "common/grouped_gemm_sm90.h"
#include "common/sm90_dense_plain.h"
#include "common/gemm_sm80.h"

namespace pykernels::gemm {

// Read on every call (a getenv, nanoseconds beside a GEMM), so one process can time or check both
// sides (tests/test_real_shapes_cuda.py).
inline bool sm90_enabled_by_env() {
  const char* value = std::getenv("PYKERNELS_SM90");
  return value == nullptr || std::string(value) != "0";
}

// The sm_90a kernels are built, enabled and run on this device.
inline bool sm90_usable(int device) { return sm90_enabled_by_env() && grouped_gemm_sm90_available(device); }

// A workspace for an sm_90a kernel, from torch's caching allocator.
inline at::Tensor sm90_workspace(int64_t bytes, int device) {
  return at::empty({bytes}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
}

// The tile PYKERNELS_SM90_TILE names for g, else the default's rule.
inline Sm90Tile sm90_tile_of(const GroupedGemmSm90Params& g) {
  return env_knob<Sm90Tile>("PYKERNELS_SM90_TILE", [&](const char* setting, Sm90Tile* tile) {
    return sm90_tile_for(setting, mean_group_rows(g), g.n, tile);
  });
}

// Runs g on the tile PYKERNELS_SM90_TILE names, in the tile order PYKERNELS_SM90_RASTER names and, for
// a dense GEMM, on the kernel PYKERNELS_SM90_DENSE names (each read on every call, so one process can
// time every choice: benchmarks/tile_sweep.py), else the defaults (common/sm90_tiles.h,
// common/sm90_tile_order.h, common/sm90_dense_plain.h). keep_tile: run on g.tile as given (a caller
// that had to choose, the gated GEMM).
inline void run_grouped_gemm_sm90(GroupedGemmSm90Params g, int device, cudaStream_t stream, bool keep_tile = false) {
  if (!keep_tile) g.tile = sm90_tile_of(g);
  g.order = env_knob<Sm90TileOrder>("PYKERNELS_SM90_RASTER", sm90_tile_order_for);
  g.plain = env_knob<bool>("PYKERNELS_SM90_DENSE", sm90_dense_plain_for);
  const at::Tensor workspace = sm90_workspace(grouped_gemm_sm90_workspace_bytes(g, device), device);
  const char* error = launch_grouped_gemm_sm90(g, workspace.data_ptr(), device, stream);
  TORCH_CHECK(error == nullptr, error);
}

// Runs p on the sm_90a core and returns true when the core takes it (dense_gemm_as_group) and runs
// on this device; else false: nothing ran.
inline bool try_gemm_sm90(const gemm::GemmParams& p, int device, cudaStream_t stream) {
  GroupedGemmSm90Params g{};
  if (!dense_gemm_as_group(p, g) || !sm90_usable(device)) return false;
  run_grouped_gemm_sm90(g, device, stream);
  return true;
}

// A dense GEMM on the current device: the sm_90a core when it takes p, else lora.cu's sm80 GEMM.
inline void run_gemm(const gemm::GemmParams& p, cudaStream_t stream) {
  if (try_gemm_sm90(p, c10::cuda::current_device(), stream)) return;
  const char* error = gemm::launch_gemm(p, stream);
  TORCH_CHECK(error == nullptr, error);
}

}  // namespace pykernels::gemm
