// A dense GEMM (lora.h's GemmParams: the LoRA and logprobs ops) as the one-group problem of the
// Hopper GEMM core (common/grouped_gemm_sm90.h). Torch- and CUDA-free: host-tested through
// pykernels._C.host_logic.
#pragma once

#include <cstdint>

#include "common/grouped_gemm_sm90.h"
#include "lora/lora.h"

namespace pykernels::gemm {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Fills g with p as one group and returns true when the core can take p: bf16 operands, bf16 or
// fp32 D, op_a and op_b not both transposed, C absent or laid out like D, sizes >= 1, 16-byte
// strides, pointers and contiguous extents (as CUTLASS's own alignment check asks of TMA
// operands). Whether the device can run it is the caller's question.
inline bool dense_gemm_as_group(const lora::GemmParams& p, GroupedGemmSm90Params& g) {
  if (p.ab_dtype != DType::kBFloat16 || (p.d_dtype != DType::kBFloat16 && p.d_dtype != DType::kFloat32)) return false;
  if (p.a_transposed && p.b_transposed) return false;
  if (p.m < 1 || p.n < 1 || p.k < 1 || (p.c != nullptr && p.ldc != p.ldd)) return false;
  const int64_t d_per_16_bytes = 16 / dtype_bytes(p.d_dtype);
  if (p.lda % 8 != 0 || p.ldb % 8 != 0 || p.ldd % d_per_16_bytes != 0) return false;
  const int64_t a_contiguous = p.a_transposed ? p.m : p.k, b_contiguous = p.b_transposed ? p.k : p.n;
  if (a_contiguous % 8 != 0 || b_contiguous % 8 != 0 || p.n % d_per_16_bytes != 0) return false;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.c) || !aligned16(p.d)) return false;
  g = GroupedGemmSm90Params{};
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
  return true;
}

}  // namespace pykernels::gemm
