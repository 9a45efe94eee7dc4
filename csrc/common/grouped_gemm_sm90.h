// The Hopper GEMM core (common/grouped_gemm_sm90.cu): CUTLASS 3.x ptr-array grouped GEMMs with TMA
// loads and a warp-specialized persistent wgmma mainloop, bf16 operands, fp32 accumulation, one
// group per expert whose problem the device computes from expert_offsets (common/gemm_groups.h),
// or one group for a dense GEMM (expert_offsets null, experts 1). Torch-free: included by .cu files.
//
//   kRowsKMajorB  D[s, :n] = alpha A[s, :k] B_e^T + beta C[s]     B_e [n, k], row stride ldb
//   kRowsNMajorB  D[s, :n] = alpha A[s, :k] B_e   + beta C[s]     B_e [k, n], row stride ldb
//   kWeightGrad   D_e[:m, :n] = alpha sum_{s of e} A[s, :m]^T B[s, :n] + beta C_e
//                 (an expert without slots gets beta C_e: its group reads zeros, never K = 0)
// Extra K (kRows*, bf16 D, when a2 is given): D[s, :n] = alpha (A[s, :k] op(B_e) + A2[s, :k2]
//               op(B2_e)) + beta C[s], one accumulation over both pairs
//               (common/extended_k_array_mainloop_sm90.cuh): the MoE experts' LoRA, x W_e^T +
//               u B_e^T and dy W_e + v A_e, in one GEMM. A2 [slots, k2] row stride lda2; B2_e at
//               e * b2_expert_stride laid out like B (K-major [n, k2] with row stride ldb2 for
//               kRowsKMajorB, N-major [k2, n] for kRowsNMajorB).
// Gated (kRowsKMajorB, bf16 D, no C, when act_out is given): B_e [n, k] holds n / 2 gate rows, then
//               n / 2 up rows (the MoE gate_up weight); the GEMM reads them paired (common/
//               paired_rows.h), so D[s, 2j] = gate_j and D[s, 2j + 1] = up_j (extra K's B2_e, if any,
//               must come in that paired row order), and its epilogue also writes
//               act_out[s, j] = act(gate_j) * up_j (moe/gated_act.h; act_out [slots, n / 2] bf16).
// Gathered A (a_rows given: the gated GEMM, or kRowsNMajorB with bf16 D): A's row for slot s is
//               a[a_rows[s]] (row stride lda) instead of a[s], read by the GEMM's producer warp
//               (extended_k_array_mainloop_sm90.cuh, kGatherA); extra K's A2 stays in slot order.
// s runs over the slots of group e; A [slots, *] and B (kWeightGrad) are row-major with row strides
// lda / ldb; D and C (which may alias D, or be null when beta == 0) are row-major with row stride
// ldd, bf16 or fp32. Rows of slots no group owns (the dropped bucket) are not written. TMA needs
// every row stride and expert stride a multiple of 16 bytes and every base pointer 16-byte aligned:
// checked, with an error. Callers also keep each operand's contiguous extent (k of A and of a
// K-major B, n of an N-major B and of D, m of kWeightGrad's A) a multiple of 16 bytes, as CUTLASS's
// own check asks of TMA operands (it cannot run here: the shapes live on the device). Built only
// when the archs include sm_90a; grouped_gemm_sm90_available says whether it runs on a device
// (compute capability 9.0).
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/paired_rows.h"
#include "common/sm90_tile_order.h"
#include "common/sm90_tiles.h"
#include "common/tails.h"
#include "moe/gated_act.h"

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
  const void* zeros;              // grouped kWeightGrad: max(m, n) bf16 zeros, 16-byte aligned
  Sm90Tile tile;                  // the kernels' tile configuration (common/sm90_tiles.h)
  Sm90TileOrder order;            // the scheduler's walk over the output tiles (common/sm90_tile_order.h)
  const void* a2;                 // extra K: bf16 [slots, k2], or null (none)
  int64_t lda2;
  const void* b2;                 // bf16, B's layout
  int64_t ldb2, b2_expert_stride, k2;
  void* act_out;                  // gated: bf16 [slots, n / 2], or null (not gated)
  moe::GatedActSpec act_spec;
  const int64_t* a_rows;          // gathered A: a's row of each slot, or null (a in slot order)
  bool plain;                     // a dense GEMM asks for the plain kernel (common/sm90_dense_plain.h)
};

// The mean group's M, for the tile rule (sm90_tile_for): a rows GEMM's slots per group, a weight
// gradient's m (every group's).
inline int64_t mean_group_rows(const GroupedGemmSm90Params& p) {
  return p.kind == Sm90GemmKind::kWeightGrad ? p.m : p.slots / (p.experts > 0 ? p.experts : 1);
}

// What TMA and the 32-bit CUTLASS problem shapes need of p, or null (checked by the launcher;
// host-tested through pykernels._C.host_logic).
inline const char* grouped_gemm_sm90_error(const GroupedGemmSm90Params& p) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (p.slots < 0 || p.slots >= kMax || p.experts < 1 || p.experts >= kMax)
    return "need 0 <= slots < 2^31 and 1 <= groups < 2^31";
  if (p.expert_offsets == nullptr && p.experts != 1) return "a dense GEMM (no expert_offsets) is one group";
  if (p.d_dtype != DType::kBFloat16 && p.d_dtype != DType::kFloat32) return "D must be bf16 or fp32";
  const bool weight_grad = p.kind == Sm90GemmKind::kWeightGrad;
  if ((weight_grad ? p.m : p.k) < 1 || p.n < 1 || p.m >= kMax || p.n >= kMax || p.k >= kMax)
    return "GEMM sizes must lie in [1, 2^31)";
  const int64_t d_per_16_bytes = 16 / dtype_bytes(p.d_dtype);
  if (p.lda < 1 || p.lda % 8 != 0 || p.ldb < 1 || p.ldb % 8 != 0 || p.ldd < 1 || p.ldd % d_per_16_bytes != 0)
    return "every row stride must be a multiple of 16 bytes";
  if ((!weight_grad && p.b_expert_stride % 8 != 0) || (weight_grad && p.d_expert_stride % d_per_16_bytes != 0))
    return "the expert strides must be multiples of 16 bytes";
  if (!is_aligned(p.a, 16) || !is_aligned(p.b, 16) || !is_aligned(p.d, 16) || !is_aligned(p.c, 16) ||
      !is_aligned(p.zeros, 16))
    return "a, b, c, d and zeros must be 16-byte aligned";
  // grouped: an expert without slots reads the zero buffer; dense: the one group must have slots
  if (weight_grad && p.expert_offsets != nullptr && p.zeros == nullptr)
    return "the grouped weight gradient needs the zero buffer";
  if (weight_grad && p.expert_offsets == nullptr && p.slots < 1) return "a dense A^T B needs K >= 1";
  if ((p.c == nullptr) != (p.beta == 0.0f)) return "c must be given iff beta != 0";
  if (p.a2 != nullptr) {  // extra K
    if (weight_grad || p.d_dtype != DType::kBFloat16) return "extra K is for kRows* GEMMs with bf16 D";
    if (p.k2 < 1 || p.k2 >= kMax || p.b2 == nullptr) return "extra K needs b2 and 1 <= k2 < 2^31";
    if (p.lda2 < 1 || p.lda2 % 8 != 0 || p.ldb2 < 1 || p.ldb2 % 8 != 0 || p.b2_expert_stride % 8 != 0 ||
        !is_aligned(p.a2, 16) || !is_aligned(p.b2, 16))
      return "extra K's row and expert strides must be multiples of 16 bytes and a2, b2 16-byte aligned";
    if (p.k2 % 8 != 0 || (p.kind == Sm90GemmKind::kRowsNMajorB && p.n % 8 != 0))
      return "extra K's contiguous extents must be multiples of 16 bytes";
  }
  if (p.act_out != nullptr) {  // gated
    if (p.kind != Sm90GemmKind::kRowsKMajorB || p.d_dtype != DType::kBFloat16 || p.c != nullptr)
      return "the gated GEMM is a kRowsKMajorB GEMM with bf16 D and no C";
    if (const char* error = paired_rows_error(p.n, p.k, p.ldb, 2, sm90_tile_columns(p.tile), kSm90TileK,
                                              sm90_tile_cluster_m(p.tile)))
      return error;
  }
  if (p.a_rows != nullptr) {  // gathered A
    if (p.act_out == nullptr && (p.kind != Sm90GemmKind::kRowsNMajorB || p.d_dtype != DType::kBFloat16))
      return "a gathered A is for the gated GEMM or a kRowsNMajorB GEMM with bf16 D";
    if (p.k % 8 != 0 || (p.a2 != nullptr && p.k2 % 8 != 0))
      return "a gathered A copies 16-byte chunks: k (and k2) must be multiples of 8";
  }
  return nullptr;
}

bool grouped_gemm_sm90_built();  // compiled for sm_90a into this build
bool grouped_gemm_sm90_available(int device);
int64_t grouped_gemm_sm90_workspace_bytes(const GroupedGemmSm90Params& p, int device);
// nullptr on success, else a message.
const char* launch_grouped_gemm_sm90(const GroupedGemmSm90Params& p, void* workspace, int device,
                                     cudaStream_t stream);

}  // namespace pykernels::gemm
