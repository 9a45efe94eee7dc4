// The sm80 GEMM of the ops' dense products (CUTLASS 2.x device::GemmUniversal: mma.sync tensor
// cores, or SIMT for fp32 and unaligned operands), which also runs on Hopper. Torch-free: the
// LoRA and logprobs bindings reach it through gemm::run_gemm (common/gemm_sm90_torch.h), which
// takes the sm_90a core instead where it applies.
#pragma once

#include <cstdint>

#include "common/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::gemm {

// D = alpha * op_a(A) @ op_b(B) + beta * C, all row-major. op_a(A) is [m, k]: A stored [m, k]
// (lda >= k), or with a_transposed stored [k, m] (lda >= m). op_b(B) is [k, n]: B stored [k, n]
// (ldb >= n), or with b_transposed stored [n, k] (ldb >= k). A and B share ab_dtype; C and D have
// d_dtype, which is ab_dtype or kFloat32 (fp32 output of a 16-bit GEMM). Accumulation is fp32;
// fp32 inputs use full fp32 arithmetic (no TF32), like torch's default. C may be null iff beta == 0;
// C may alias D (in-place accumulate).
struct GemmParams {
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  bool a_transposed;
  const void* b;
  int64_t ldb;
  bool b_transposed;
  const void* c;
  int64_t ldc;
  void* d;
  int64_t ldd;
  DType ab_dtype;
  DType d_dtype;
  float alpha;
  float beta;
};

// Returns nullptr on success, else a message saying what failed (can_implement / workspace /
// initialize / run), e.g. "gemm: alignment of an operand not supported by ...".
const char* launch_gemm(const GemmParams& params, cudaStream_t stream);

}  // namespace pykernels::gemm
