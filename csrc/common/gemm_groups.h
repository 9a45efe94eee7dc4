// The groups of the sm_90a grouped GEMM (common/grouped_gemm_sm90.cu): one thread per group turns
// expert_offsets into a GEMM shape and operand offsets on the device, so the CUTLASS ptr-array
// kernel gets its problem list without a host synchronization. Shared with the host tests
// (pykernels._C.host_logic). Vocabulary as in moe/moe.h (a dense GEMM is one group holding every
// slot); offsets are clamped by bucket_slots, so malformed routing gives wrong numbers, never an
// out-of-bounds access.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "moe/moe_schedule.h"

namespace pykernels::gemm {

// One group of a grouped GEMM: D[m, n] (+)= sum_k A[m, k] B[k, n], and where A, B and D start
// (element offsets from the operands' base pointers; C, when read, has D's). zeros: A and B read
// the zero buffer instead (k = 1), so the group's product is zero.
struct GroupProblem {
  int64_t m, n, k;
  int64_t a_offset, b_offset, d_offset;
  bool zeros;
};

// The slots of group e: expert e's (clamped), or all of them for a dense GEMM (offsets null).
PYKERNELS_HOST_DEVICE inline moe::SlotRange group_slots(const int64_t* offsets, int64_t experts, int64_t slots,
                                                        int64_t e) {
  return offsets != nullptr ? moe::bucket_slots(offsets, experts, slots, e) : moe::SlotRange{0, slots};
}

// Row-grouped GEMM: expert e's slots are its rows. A [slots, k] row-major with row stride lda,
// B_e at e * b_expert_stride (its own layout, any leading dimension), D [slots, n] with row stride
// ldd. An expert without slots is an empty group (m = 0: no tiles).
PYKERNELS_HOST_DEVICE inline GroupProblem rows_group(const int64_t* offsets, int64_t experts, int64_t slots,
                                                     int64_t e, int64_t n, int64_t k, int64_t lda,
                                                     int64_t b_expert_stride, int64_t ldd) {
  const moe::SlotRange r = group_slots(offsets, experts, slots, e);
  return {r.end - r.begin, n, k, r.begin * lda, e * b_expert_stride, r.begin * ldd, false};
}

// The second operand pair of a rows group with extra K (grouped_gemm_sm90.h): A2's rows start at the
// group's first slot (row stride lda2), B2_e at e * b2_expert_stride, and the problem's K covers
// both pairs in whole k tiles of block_k (the extra-K mainloop takes ceil(k / block_k) tiles from
// the first pair, then ceil(k2 / block_k) from the second; TMA zero-fills each pair's last tile).
struct ExtraKGroup {
  int64_t a2_offset, b2_offset, k;
};
PYKERNELS_HOST_DEVICE inline ExtraKGroup extra_k_group(const int64_t* offsets, int64_t experts, int64_t slots,
                                                       int64_t e, int64_t k, int64_t k2, int64_t lda2,
                                                       int64_t b2_expert_stride, int64_t block_k) {
  const moe::SlotRange r = group_slots(offsets, experts, slots, e);
  return {r.begin * lda2, e * b2_expert_stride, ceil_div(k, block_k) * block_k + ceil_div(k2, block_k) * block_k};
}

// Slot-reduction GEMM (weight gradients): expert e's slots are the reduction. A is [slots, m] read
// transposed (column-major M x K, column stride lda), B [slots, n] row-major with row stride ldb,
// D_e [m, n] at e * d_expert_stride. An expert without slots must still get zeros, and a k = 0
// problem would leave CUTLASS's accumulators unset: it reads one zero column instead (the zero
// buffer holds max(m, n) elements).
PYKERNELS_HOST_DEVICE inline GroupProblem weight_grad_group(const int64_t* offsets, int64_t experts, int64_t slots,
                                                            int64_t e, int64_t m, int64_t n, int64_t lda,
                                                            int64_t ldb, int64_t d_expert_stride) {
  const moe::SlotRange r = group_slots(offsets, experts, slots, e);
  if (r.end == r.begin) return {m, n, 1, 0, 0, e * d_expert_stride, true};
  return {m, n, r.end - r.begin, r.begin * lda, r.begin * ldb, e * d_expert_stride, false};
}

}  // namespace pykernels::gemm
