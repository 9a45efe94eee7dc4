// A dense GEMM (gemm_sm80.h's GemmParams: the LoRA and logprobs ops) as the one-group problem of the
// Hopper GEMM core (common/grouped_gemm_sm90.h). Torch- and CUDA-free: host-tested through
// pykernels._C.host_logic.
#pragma once

#include <cstdint>

#include "common/grouped_gemm_sm90.h"
#include "common/tails.h"
#include "common/gemm_sm80.h"

namespace pykernels::gemm {

// Fills g with p as one group and returns true when the core can take p: bf16 operands, bf16 or
// fp32 D, op_a and op_b not both transposed, C absent or laid out like D, sizes >= 1, 16-byte
// strides, pointers and contiguous extents (as CUTLASS's own alignment check asks of TMA
// operands). Whether the device can run it is the caller's question.
inline bool dense_gemm_as_group(const gemm::GemmParams& p, GroupedGemmSm90Params& g) {
  if (p.ab_dtype != DType::kBFloat16 || (p.d_dtype != DType::kBFloat16 && p.d_dtype != DType::kFloat32)) return false;
  if (p.a_transposed && p.b_transposed) return false;
  if (p.m < 1 || p.n < 1 || p.k < 1 || (p.c != nullptr && p.ldc != p.ldd)) return false;
  const int d_bytes = dtype_bytes(p.d_dtype), d_per_16_bytes = 16 / d_bytes;
  if (!rows_vector_aligned(p.a, p.lda, p.a_transposed ? p.m : p.k, 8, 2) ||
      !rows_vector_aligned(p.b, p.ldb, p.b_transposed ? p.k : p.n, 8, 2) ||
      !rows_vector_aligned(p.d, p.ldd, p.n, d_per_16_bytes, d_bytes) || !is_aligned(p.c, 16))
    return false;
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
