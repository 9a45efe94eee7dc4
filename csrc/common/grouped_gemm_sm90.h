// The Hopper GEMM core (common/grouped_gemm_sm90.cu): CUTLASS 3.x ptr-array grouped GEMMs with TMA
// loads and a warp-specialized persistent wgmma mainloop, bf16 operands, fp32 accumulation, one
// group per expert whose problem the device computes from expert_offsets (common/gemm_groups.h),
// or one group for a dense GEMM (expert_offsets null, experts 1). Torch-free: included by .cu files.
//
//   kRowsKMajorB  D[s, :n] = alpha A[s, :k] B_e^T + beta C[s]     B_e [n, k], row stride ldb
//   kRowsNMajorB  D[s, :n] = alpha A[s, :k] B_e   + beta C[s]     B_e [k, n], row stride ldb
//   kWeightGrad   D_e[:m, :n] = alpha sum_{s of e} A[s, :m]^T B[s, :n] + beta C_e
//                 (an expert without slots gets beta C_e: its group reads zeros, never K = 0)
// s runs over the slots of group e; A [slots, *] and B (kWeightGrad) are row-major with row strides
// lda / ldb; D and C (which may alias D, or be null when beta == 0) are row-major with row stride
// ldd, bf16 or fp32. Rows of slots no group owns (the dropped bucket) are not written. TMA needs
// every row stride and expert stride a multiple of 16 bytes and every base pointer 16-byte aligned:
// checked, with an error. Callers also keep each operand's contiguous extent (k of A and of a
// K-major B, n of an N-major B and of D, m of kWeightGrad's A) a multiple of 16 bytes, as CUTLASS's
// own check asks of TMA operands (it cannot run here: the shapes live on the device). Built only when the archs include sm_90a; grouped_gemm_sm90_available
// says whether it runs on a device (compute capability 9.0).
#pragma once

#include <cstdint>

#include "common/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::gemm {

enum class Sm90GemmKind { kRowsKMajorB, kRowsNMajorB, kWeightGrad };

struct GroupedGemmSm90Params {
  Sm90GemmKind kind;
  int64_t slots, experts;
  const int64_t* expert_offsets;  // [experts + 1], or null: one group of all slots
  int64_t m, n, k;                // kRows*: n and k (m is each group's slot count); kWeightGrad: m and n
  const void* a;                  // bf16
  int64_t lda;
  const void* b;                  // bf16
  int64_t ldb, b_expert_stride;
  const void* c;                  // d_dtype, D's layout; null iff beta == 0
  void* d;
  int64_t ldd, d_expert_stride;
  DType d_dtype;                  // kBFloat16 or kFloat32
  float alpha, beta;
  const void* zeros;              // kWeightGrad: max(m, n) bf16 zeros, 16-byte aligned
};

bool grouped_gemm_sm90_built();  // compiled for sm_90a into this build
bool grouped_gemm_sm90_available(int device);
int64_t grouped_gemm_sm90_workspace_bytes(const GroupedGemmSm90Params& p, int device);
// nullptr on success, else a message.
const char* launch_grouped_gemm_sm90(const GroupedGemmSm90Params& p, void* workspace, int device,
                                     cudaStream_t stream);

}  // namespace pykernels::gemm
