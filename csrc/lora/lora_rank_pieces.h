// The LoRA op's rank-r products with an fp32 factor on tensor cores (PYKERNELS_LORA_RANK_GEMM=
// tensor_core): each fp32 factor f becomes three bf16 pieces,
//
//   hi = bf16(f),  mid = bf16(f - hi),  lo = bf16(f - hi - mid),   f = hi + mid + lo + e,
//
// with both differences exact in fp32 and |e| <= 2^-24 |f| (three 8-bit significands cover fp32's
// 24). A product of a bf16 activation (exact) with f is then three bf16 products, each exact in the
// tensor core's fp32 accumulator: the pieces ride as 3r columns (or rows) of one bf16 GEMM with an
// fp32 output, and a small pass adds the three blocks, lo + mid first. So fp32 LoRA factors keep
// fp32 precision (as the SIMT rank GEMM, lora.h launch_rank_gemm, and PEFT's fp32 adapters do) at
// tensor-core speed: the H100 measured the SIMT products at ~15 TFLOP/s, PEFT 0.70-0.84x ahead of
// us at r 64 (benchmarks/results/h100.md, 2026-11-27).
//
// The products (x bf16 [M, K], dy bf16 [M, N], A [r, K], B [N, r], xa and dxa fp32 [M, r]):
//   xa   = x A^T      x [A_hi; A_mid; A_lo]^T -> [M, 3r], column blocks summed
//   dxa  = s dy B     dy [B_hi | B_mid | B_lo] -> [M, 3r]
//   dB   = s dy^T xa  dy^T [xa_hi | xa_mid | xa_lo] -> [N, 3r]
//   dA   = dxa^T x    [dxa_hi | dxa_mid | dxa_lo]^T x -> [3r, K], row blocks summed
//   dxa A (grad_x's LoRA term; both factors split): six of the nine piece products, as extra K of one
//        GEMM, [dxa_hi dxa_hi dxa_mid dxa_hi dxa_lo dxa_mid] [A_hi; A_mid; A_hi; A_lo; A_hi; A_mid]:
//        hi hi, hi mid, mid hi, hi lo, lo hi, mid mid (each left out is at most 2^-24 |dxa| |A|)
// Torch- and CUDA-free: lora.cu's kernels and the host tests (pykernels._C.host_logic) share it.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"
#include "common/two_way_choice.h"
#include "lora/lora_extended_k.h"  // bf16_rounded, non_finite_bits

namespace pykernels::lora {

// PYKERNELS_LORA_RANK_GEMM (`setting`; null or empty: the default):
//   tensor_core  the pieces above on the tensor-core GEMM (bf16 x only; fp16 and fp32 x keep simt). The
//                default: on an H100 a LoRA forward+backward (4096 x 14336, T 8192, fp32 adapters) took
//                3.40 ms against simt's 4.42 at r 16 and 3.50 against 6.99 at r 64 (benchmarks/results/
//                h100.md, 2026-11-27 second lease)
//   simt         launch_rank_gemm: fp32 FMA, split over k
// Sets *simt (the other side, as every two-way knob sets); null on success, else a message naming the
// choices. Read on every call.
inline const char* lora_rank_gemm_for(const char* setting, bool* simt) {
  return two_way_choice(setting, "tensor_core", "simt",
                        "PYKERNELS_LORA_RANK_GEMM must be tensor_core (the default) or simt", simt);
}

inline constexpr int kMaxPieceBlocks = 6;
enum Piece : int8_t { kHi = 0, kMid = 1, kLo = 2 };

// Piece `piece` of f. A non-finite f is its own hi (mid and lo 0), so inf stays inf in the sum; a
// finite f whose nearest bf16 overflows (|f| above bf16's largest, 3.39e38) takes f truncated
// instead. Subnormal pieces are exact to half a bf16 subnormal step (2^-134).
PYKERNELS_HOST_DEVICE inline float bf16_piece(float f, int piece) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  if (non_finite_bits(bits)) return piece == kHi ? f : 0.0f;
  float hi = bf16_rounded(f);
  uint32_t hi_bits;
  memcpy(&hi_bits, &hi, sizeof hi_bits);
  if (non_finite_bits(hi_bits)) {  // rounded past the largest bf16
    hi_bits = bits & 0xffff0000u;
    memcpy(&hi, &hi_bits, sizeof hi);
  }
  if (piece == kHi) return hi;
  const float rest = add_rn(f, -hi);  // exact: hi is f rounded to bf16
  const float mid = bf16_rounded(rest);
  return piece == kMid ? mid : bf16_rounded(add_rn(rest, -mid));
}

// One bf16 matrix holding `blocks` pieces of an fp32 [rows, cols] matrix, block b being piece
// piece[b]: side by side ([rows, blocks cols], block b = columns [b cols, (b + 1) cols)) or
// stacked ([blocks rows, cols]). The fp32 product of two such operands has the same blocks.
struct PieceLayout {
  int64_t rows, cols;
  bool stacked;
  int blocks;
  int8_t piece[kMaxPieceBlocks];
};

inline PieceLayout three_pieces(int64_t rows, int64_t cols, bool stacked) {
  return {rows, cols, stacked, 3, {kHi, kMid, kLo, kHi, kHi, kHi}};
}

// The grad_x term's operands: dxa's pieces side by side, A's stacked, matched block for block.
inline PieceLayout dxa_term_pieces(int64_t m, int64_t r) { return {m, r, false, 6, {kHi, kHi, kMid, kHi, kLo, kMid}}; }
inline PieceLayout a_term_pieces(int64_t r, int64_t k) { return {r, k, true, 6, {kHi, kMid, kHi, kLo, kHi, kMid}}; }

// Where block b's element (i, j) lies in the blocked matrix (row-major, no padding).
PYKERNELS_HOST_DEVICE inline int64_t piece_offset(const PieceLayout& l, int b, int64_t i, int64_t j) {
  return l.stacked ? (b * l.rows + i) * l.cols + j : i * (l.blocks * l.cols) + b * l.cols + j;
}

// out(i, j) from an fp32 product laid out as l (three blocks hi, mid, lo): lo + mid first, then hi.
PYKERNELS_HOST_DEVICE inline float sum_pieces_at(const PieceLayout& l, const float* product, int64_t i, int64_t j) {
  return add_rn(add_rn(product[piece_offset(l, 2, i, j)], product[piece_offset(l, 1, i, j)]),
                product[piece_offset(l, 0, i, j)]);
}

}  // namespace pykernels::lora
