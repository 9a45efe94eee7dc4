// The torch side of the Hopper GEMM core (common/grouped_gemm_sm90.h): whether a call may use it,
// and the dense GEMMs of the LoRA and logprobs ops (lora::GemmParams) run on it as one group, with
// the workspace from torch's caching allocator. Included by *_cuda_torch.cpp files only.
//
// PYKERNELS_SM90=0 in the environment keeps every op on its sm80 kernels (to compare the two on one
// GPU, or to step around a Hopper kernel while the dispatcher's check has not caught it).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/grouped_gemm_sm90.h"
#include "lora/lora.h"

namespace pykernels::gemm {

// Read on every call (a getenv, nanoseconds beside a GEMM), so one process can time or check both
// sides (tests/test_real_shapes_cuda.py).
inline bool sm90_enabled_by_env() {
  const char* value = std::getenv("PYKERNELS_SM90");
  return value == nullptr || std::string(value) != "0";
}

// The sm_90a kernels are built, enabled and run on this device.
inline bool sm90_usable(int device) { return sm90_enabled_by_env() && grouped_gemm_sm90_available(device); }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void run_grouped_gemm_sm90(const GroupedGemmSm90Params& g, int device, cudaStream_t stream) {
  const at::Tensor workspace = at::empty({grouped_gemm_sm90_workspace_bytes(g, device)},
                                         at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
  const char* error = launch_grouped_gemm_sm90(g, workspace.data_ptr(), device, stream);
  TORCH_CHECK(error == nullptr, error);
}

// Runs p (lora.h's GemmParams) on the sm_90a core and returns true when the core takes it: bf16
// operands, bf16 or fp32 D, op_a and op_b not both transposed, C absent or laid out like D, sizes
// >= 1, 16-byte strides, pointers and contiguous extents, a compute capability 9.0 device. Else
// false: nothing ran.
inline bool try_gemm_sm90(const lora::GemmParams& p, int device, cudaStream_t stream) {
  if (p.ab_dtype != DType::kBFloat16 || (p.d_dtype != DType::kBFloat16 && p.d_dtype != DType::kFloat32)) return false;
  if (p.a_transposed && p.b_transposed) return false;
  if (p.m < 1 || p.n < 1 || p.k < 1 || (p.c != nullptr && p.ldc != p.ldd)) return false;
  const int64_t d_per_16_bytes = 16 / dtype_bytes(p.d_dtype);
  if (p.lda % 8 != 0 || p.ldb % 8 != 0 || p.ldd % d_per_16_bytes != 0) return false;
  // the contiguous extent of every operand a whole number of 16-byte vectors, as CUTLASS's own
  // alignment check asks of TMA operands
  const int64_t a_contiguous = p.a_transposed ? p.m : p.k, b_contiguous = p.b_transposed ? p.k : p.n;
  if (a_contiguous % 8 != 0 || b_contiguous % 8 != 0 || p.n % d_per_16_bytes != 0) return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.c) || !aligned16(p.d)) return false;
  if (!sm90_usable(device)) return false;
  GroupedGemmSm90Params g{};
  g.experts = 1;  // expert_offsets null: one group of all slots
  g.n = p.n;
  g.a = p.a;
  g.lda = p.lda;
  g.b = p.b;
  g.ldb = p.ldb;
  g.c = p.beta != 0.0f ? p.c : nullptr;
  g.d = p.d;
  g.ldd = p.ldd;
  g.d_dtype = p.d_dtype;
  g.alpha = p.alpha;
  g.beta = g.c != nullptr ? p.beta : 0.0f;
  if (p.a_transposed) {  // D = A^T B with A [k, m], B [k, n]: a weight-gradient product, k as slots
    g.kind = Sm90GemmKind::kWeightGrad;
    g.slots = p.k;
    g.m = p.m;
  } else {  // rows of A times B^T (B stored [n, k]) or B (stored [k, n])
    g.kind = p.b_transposed ? Sm90GemmKind::kRowsKMajorB : Sm90GemmKind::kRowsNMajorB;
    g.slots = p.m;
    g.k = p.k;
  }
  run_grouped_gemm_sm90(g, device, stream);
  return true;
}

// A dense GEMM on the current device: the sm_90a core when it takes p, else lora.cu's sm80 GEMM.
inline void run_gemm(const lora::GemmParams& p, cudaStream_t stream) {
  if (try_gemm_sm90(p, c10::cuda::current_device(), stream)) return;
  const char* error = lora::launch_gemm(p, stream);
  TORCH_CHECK(error == nullptr, error);
}

}  // namespace pykernels::gemm
