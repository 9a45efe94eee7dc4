// Fused LoRA linear: shared declarations of the CUDA implementation (torch-free: included by .cu
// files that must compile against a CPU-only torch).
//
// The ops (schemas in csrc/torch_bindings.cpp, CPU in lora_cpu.cpp, CUDA in lora_cuda_torch.cpp):
//   forward   y  = x W^T + bias + scaling * (x_lora A^T) B^T,   xa = x_lora A^T (fp32, kept for backward)
//   backward  dxa = scaling * dy B              (fp32)
//             dB  = scaling * dy^T xa           (fp32 accumulation, stored in B's dtype)
//             dA  = dxa^T x_lora                (fp32 accumulation, stored in A's dtype)
//             dx  = dy W (+ dxa A when x_lora is x itself: fused into the same GEMM as its C operand)
// x [M, K], W [N, K], A [r, K], B [N, r]; x_lora defaults to x (it differs only under LoRA dropout).
// The CUDA side composes them from GEMMs (cuBLAS through ATen for the base weight; the GEMM core of
// csrc/common/ for the tensor-core products with an fp32 output) and the small kernels below (the
// LoRA term, rank-r GEMMs of mixed dtypes that keep fp32 LoRA weights and intermediates fp32, casts).
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"
#include "lora/lora_extended_k.h"
#include "lora/lora_rank_pieces.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::lora {

// out[m, n] = scaling * sum_j xa[m, j] * b[n, j] + (bias ? bias[n] : 0), computed in fp32 and
// stored as out_dtype: the LoRA term (plus bias), used as the C operand of the base GEMM.
struct LowRankParams {
  int64_t m, n, r;
  const float* xa;  // [m, r] fp32, row stride r
  const void* b;    // [n, r] of b_dtype, row stride r
  DType b_dtype;
  const void* bias; // [n] of out_dtype or null
  float scaling;
  void* out;        // [m, n] of out_dtype, row stride n
  DType out_dtype;
};
const char* launch_low_rank_term(const LowRankParams& params, cudaStream_t stream);

// D[m, n] = alpha * sum_k op_a[i, kk] * op_b[kk, j] (+ D when accumulate), with op_a[i, kk] =
// a[i * a_stride_m + kk * a_stride_k] and op_b[kk, j] = b[kk * b_stride_k + j * b_stride_n]: any
// strides, any alignment, A and B each of its own dtype, read as fp32 and summed in fp32 (no TF32),
// rounded once to d_dtype. The rank-r products whose operands mix dtypes (fp32 LoRA weights, xa,
// dxa against 16-bit activations; launch_gemm takes one input dtype): m or n is r in every use.
struct RankGemmParams {
  int64_t m, n, k;
  const void* a;  // op_a [m, k] of a_dtype
  DType a_dtype;
  int64_t a_stride_m, a_stride_k;
  const void* b;  // op_b [k, n] of b_dtype
  DType b_dtype;
  int64_t b_stride_k, b_stride_n;
  void* d;        // [m, n] of d_dtype, row stride ldd
  DType d_dtype;
  int64_t ldd;
  float alpha;
  bool accumulate;
  int sms = 0;                 // the device's multiprocessors (device_multiprocessors); 0: no split
  float* workspace = nullptr;  // rank_gemm_workspace_floats(*this) floats when that is not 0
};
const char* launch_rank_gemm(const RankGemmParams& params, cudaStream_t stream);
int device_multiprocessors(int device);

// The output tile of one CTA of the rank GEMM, by which side is the rank: 128 x 16 (n = r: xa, dxa,
// dB), 16 x 128 (m = r: dA), 64 x 64 (the rest: dxa A, r > 16).
struct RankTile {
  int64_t m, n;
};
inline RankTile rank_tile(int64_t m, int64_t n) {
  if (n <= 16) return {128, 16};
  if (m <= 16) return {16, 128};
  return {64, 64};
}

// Which rows (or columns) of its CTA's tile a thread of the rank GEMM accumulates: along an extent
// of 16, 64 or 128 (kTileM or kTileN), split over 16 threads, element i < extent / 16 of thread t.
// Where a thread owns more than one, it owns groups of 4 adjacent, at 4 t + 64 g: each group is one
// 16-byte shared-memory load. Owning t + 16 i instead took one load per element, 9 loads per 8 FMAs
// on the 128 x 16 tile, the ~15 TFLOP/s these products measured on an H100 (2026-11-27); now 3.
PYKERNELS_HOST_DEVICE constexpr int64_t rank_fragment_index(int64_t extent, int64_t t, int64_t i) {
  return extent == 16 ? t : 4 * t + 64 * (i / 4) + i % 4;
}

// Floats between the k-rows of a shared-memory slice of that extent: 16-byte aligned rows.
PYKERNELS_HOST_DEVICE constexpr int64_t rank_smem_stride(int64_t extent) { return extent + 4; }

// Thread `thread` (< 256) of a CTA whose tile has tile_m rows, as (tx, ty) of the 16 x 16 grid. The
// 16 consecutive lanes of a half-warp take 16 columns, except on the 16-row tile, where they take
// its 16 rows: on both thin tiles they so walk the side of one element per thread (16 floats in one
// 64-byte run), and a warp's 16-byte loads of the other side see 2 addresses (broadcast), not 16.
struct RankThread {
  int tx, ty;
};
PYKERNELS_HOST_DEVICE constexpr RankThread rank_thread(int64_t tile_m, int thread) {
  return tile_m == 16 ? RankThread{thread / 16, thread % 16} : RankThread{thread % 16, thread / 16};
}

// Split-k of the rank GEMM: these products have few output tiles (dy B at T 8192: 64) and long k
// (the base's 14336 features): one CTA per tile walking all of k kept 64 of an H100's 132 SMs
// busy, latency-bound, at 1.5 TFLOP/s (2.4 ms for a product that reads 235 MB). `splits` CTAs
// share each tile, each summing k_per_split of k (a multiple of the kernel's 16-deep slices, at
// least kRankMinSplitK) into its own [m, n] fp32 plane of the workspace; a second pass adds the
// planes in split order, so results do not depend on scheduling.
inline constexpr int64_t kRankCtasPerSm = 4;     // CTAs in flight per SM to hide load latency
inline constexpr int64_t kRankMinSplitK = 512;   // k per split at least: the partials stay small
inline constexpr int64_t kRankMaxSplits = 64;
struct RankSplit {
  int64_t splits, k_per_split;
};
inline RankSplit rank_gemm_split(int64_t m, int64_t n, int64_t k, int sms) {
  const RankTile tile = rank_tile(m, n);
  const int64_t tiles = ceil_div(m, tile.m) * ceil_div(n, tile.n);
  int64_t splits = tiles > 0 ? ceil_div(kRankCtasPerSm * sms, tiles) : 1;
  splits = splits < k / kRankMinSplitK ? splits : k / kRankMinSplitK;
  splits = splits < kRankMaxSplits ? splits : kRankMaxSplits;
  if (splits <= 1) return {1, k};
  const int64_t k_per_split = ceil_div(ceil_div(k, splits), 16) * 16;
  return {ceil_div(k, k_per_split), k_per_split};  // every split gets a non-empty range of k
}
inline int64_t rank_gemm_workspace_floats(const RankGemmParams& p) {
  const RankSplit split = rank_gemm_split(p.m, p.n, p.k, p.sms);
  return split.splits > 1 ? split.splits * p.m * p.n : 0;
}

// U [m, width] and V [n, width], bf16, of the LoRA forward as extra K (lora_extended_k.h: the
// columns' meaning) from xa, B and the bias.
struct ExtendedKOperandsParams {
  ExtendedK layout;
  int64_t m, n;
  const float* xa;   // [m, r] fp32
  float scaling;
  const void* b;     // [n, r] of b_dtype (fp32: three terms, bf16: two)
  DType b_dtype;
  const void* bias;  // [n] bf16 when layout.bias
  void* u;           // bf16 [m, width]
  void* v;           // bf16 [n, width]
};
const char* launch_extended_k_operands(const ExtendedKOperandsParams& params, cudaStream_t stream);

// The rank products' pieces (lora_rank_pieces.h): `out` (bf16, laid out as `layout`) from src (an
// [layout.rows, layout.cols] row-major matrix of src_dtype), and back: out [rows, cols] of out_dtype
// = the sum of the three blocks of the fp32 product laid out as `layout`.
const char* launch_split_pieces(const void* src, DType src_dtype, const PieceLayout& layout, void* out,
                                cudaStream_t stream);
const char* launch_sum_pieces(const float* product, const PieceLayout& layout, void* out, DType out_dtype,
                              cudaStream_t stream);

// dst[i] = (dst_dtype) src[i] for i < numel (fp32 <-> 16-bit casts of the small LoRA tensors).
const char* launch_cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t numel,
                        cudaStream_t stream);

}  // namespace pykernels::lora
