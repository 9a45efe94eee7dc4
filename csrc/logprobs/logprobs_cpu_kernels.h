// CPU kernels of the fused lm_head + log-softmax: the log-softmax epilogues that run on one logits
// tile while it is still in cache (the GEMMs are common/cpu_gemm_bf16.h). Torch-free;
// logprobs_cpu.cpp drives them.
//
// Tiles are transposed, [vocab rows][token columns], so every per-token reduction over the
// vocabulary is a vertical (lane-wise) one: no horizontal shuffles in the epilogues.
#pragma once

#include <cstdint>

namespace pykernels::logprobs::cpu {

// Running per-token statistics over the vocabulary seen so far, relative to the running max:
// max_z = max z, sum_exp = sum exp(z - max_z), sum_exp_z = sum exp(z - max_z) (z - max_z). Then
// log-sum-exp = max_z + log(sum_exp) and entropy = log(sum_exp) - sum_exp_z / sum_exp.
struct RunningStats {
  float* max_z;
  float* sum_exp;
  float* sum_exp_z;
};

// Folds a logits tile (z = scale * tile[v][t], rows v < rows, columns t < cols, row stride ld)
// into the running statistics of its cols tokens (already offset to the tile's first token).
void fold_tile(const float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, RunningStats stats,
               bool avx512);

// Overwrites the logits tile with e = exp(z - max_z[t]) (z = scale * tile), and writes e (z - max_z[t])
// to weighted when given (same layout): the softmax weights, relative to the running max, of the
// gradient terms accumulated in the forward (see logprobs_cpu.cpp). Columns cols..ld-1 are zeroed.
void exp_tile(float* tile, float* weighted, int64_t rows, int64_t cols, int64_t ld, float scale, const float* max_z,
              bool avx512);

// Per-token inputs of the backward epilogue (offset to the tile's first token). grad_logprob is
// zero for ignored tokens, so their gradient is exactly zero.
struct GradInputs {
  const float* lse;
  const float* entropy;
  const float* grad_logprob;
  const float* grad_entropy;
};

// Overwrites the logits tile with scale * dL/dz (z = scale * tile), i.e. the gradient with respect
// to the unscaled product h.W, except the target term, which the caller adds:
//   dz = -p (grad_logprob + grad_entropy (z - lse + entropy)),  p = exp(z - lse).
// Columns cols..ld-1 are zeroed.
void grad_tile(float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, GradInputs in, bool avx512);

// dst[r][c] = bf16(src[r][c]) and, when dst_t is given, dst_t[c][r] = the same (rows of dst_t
// padded with zeros to ld_t): dz^T and dz for the two backward GEMMs. Round to nearest even.
void to_bf16_both(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst, int64_t ld_dst,
                  uint16_t* dst_t, int64_t ld_t);

}  // namespace pykernels::logprobs::cpu
