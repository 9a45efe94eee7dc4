#include "logprobs/logprobs_cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_simd.h"

namespace pykernels::logprobs::cpu {
namespace {

PK_AVX512 void fold_tile_avx512(const float* tile, int64_t rows, int64_t cols, int64_t ld, float scale,
                                RunningStats s) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < cols; t += 16) {
    const __mmask16 m = lane_mask(cols - t);
    __m512 block_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t v = 0; v < rows; ++v) block_max = _mm512_max_ps(block_max, _mm512_maskz_loadu_ps(m, tile + v * ld + t));
    const __m512 old_max = _mm512_maskz_loadu_ps(m, s.max_z + t);
    const __m512 old_sum = _mm512_maskz_loadu_ps(m, s.sum_exp + t);
    const __m512 old_sum_z = _mm512_maskz_loadu_ps(m, s.sum_exp_z + t);
    const __m512 new_max = _mm512_max_ps(old_max, _mm512_mul_ps(block_max, vscale));
    // Re-base the old sums on the new max: exp(z - new) = alpha exp(z - old), and (z - new) =
    // (z - old) + (old - new). Tokens with nothing folded yet (sum 0, max -inf) stay at 0.
    const __m512 alpha = exp512(_mm512_sub_ps(old_max, new_max));
    const __mmask16 seen = _mm512_cmp_ps_mask(old_sum, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 old_part = _mm512_mul_ps(alpha, old_sum);
    const __m512 old_part_z = _mm512_maskz_mul_ps(
        seen, alpha, _mm512_fmadd_ps(_mm512_sub_ps(old_max, new_max), old_sum, old_sum_z));
    // The block is summed on its own and added once: a long running sum would lose ~sqrt(V) ulps.
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    __m512 sum_z0 = _mm512_setzero_ps(), sum_z1 = _mm512_setzero_ps();
    int64_t v = 0;
    for (; v + 1 < rows; v += 2) {  // two independent chains: the adds' latency, not the exp, bounds it
      const __m512 d0 = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, tile + v * ld + t), vscale, new_max);
      const __m512 d1 = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, tile + (v + 1) * ld + t), vscale, new_max);
      const __m512 e0 = exp512(d0), e1 = exp512(d1);
      sum0 = _mm512_add_ps(sum0, e0);
      sum1 = _mm512_add_ps(sum1, e1);
      sum_z0 = _mm512_fmadd_ps(e0, d0, sum_z0);
      sum_z1 = _mm512_fmadd_ps(e1, d1, sum_z1);
    }
    if (v < rows) {
      const __m512 d0 = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, tile + v * ld + t), vscale, new_max);
      const __m512 e0 = exp512(d0);
      sum0 = _mm512_add_ps(sum0, e0);
      sum_z0 = _mm512_fmadd_ps(e0, d0, sum_z0);
    }
    _mm512_mask_storeu_ps(s.max_z + t, m, new_max);
    _mm512_mask_storeu_ps(s.sum_exp + t, m, _mm512_add_ps(old_part, _mm512_add_ps(sum0, sum1)));
    _mm512_mask_storeu_ps(s.sum_exp_z + t, m, _mm512_add_ps(old_part_z, _mm512_add_ps(sum_z0, sum_z1)));
  }
}

void fold_tile_scalar(const float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, RunningStats s) {
  for (int64_t t = 0; t < cols; ++t) {
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t v = 0; v < rows; ++v) block_max = std::max(block_max, tile[v * ld + t]);
    const float old_max = s.max_z[t], new_max = std::max(old_max, block_max * scale);
    const float alpha = std::exp(old_max - new_max);
    float sum = 0.0f, sum_z = 0.0f;
    for (int64_t v = 0; v < rows; ++v) {
      const float d = tile[v * ld + t] * scale - new_max;
      const float e = std::exp(d);
      sum += e;
      sum_z += e * d;
    }
    const float old_sum = s.sum_exp[t];
    s.max_z[t] = new_max;
    s.sum_exp[t] = alpha * old_sum + sum;
    s.sum_exp_z[t] = (old_sum > 0 ? alpha * (s.sum_exp_z[t] + (old_max - new_max) * old_sum) : 0.0f) + sum_z;
  }
}

PK_AVX512 void exp_tile_avx512(float* tile, float* weighted, int64_t rows, int64_t cols, int64_t ld, float scale,
                               const float* max_z) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < ld; t += 16) {
    const __mmask16 valid = lane_mask(cols - t), inside = lane_mask(ld - t);
    const __m512 max = _mm512_maskz_loadu_ps(valid, max_z + t);
    for (int64_t v = 0; v < rows; ++v) {
      float* row = tile + v * ld + t;
      const __m512 d = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(valid, row), vscale, max);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp512(d));
      _mm512_mask_storeu_ps(row, inside, e);
      if (weighted) _mm512_mask_storeu_ps(weighted + v * ld + t, inside, _mm512_mul_ps(e, d));
    }
  }
}

void exp_tile_scalar(float* tile, float* weighted, int64_t rows, int64_t cols, int64_t ld, float scale,
                     const float* max_z) {
  for (int64_t v = 0; v < rows; ++v) {
    float* row = tile + v * ld;
    for (int64_t t = 0; t < cols; ++t) {
      const float d = row[t] * scale - max_z[t];
      row[t] = std::exp(d);
      if (weighted) weighted[v * ld + t] = row[t] * d;
    }
    std::fill(row + cols, row + ld, 0.0f);
    if (weighted) std::fill(weighted + v * ld + cols, weighted + (v + 1) * ld, 0.0f);
  }
}

PK_AVX512 void grad_tile_avx512(float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, GradInputs in) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < ld; t += 16) {
    const __mmask16 valid = lane_mask(cols - t), inside = lane_mask(ld - t);
    const __m512 lse = _mm512_maskz_loadu_ps(valid, in.lse + t);
    const __m512 ent = _mm512_maskz_loadu_ps(valid, in.entropy + t);
    const __m512 g_lp = _mm512_maskz_loadu_ps(valid, in.grad_logprob + t);
    const __m512 g_ent = _mm512_maskz_loadu_ps(valid, in.grad_entropy + t);
    const __m512 shift = _mm512_sub_ps(ent, lse);  // z - lse + entropy = z + shift
    for (int64_t v = 0; v < rows; ++v) {
      float* row = tile + v * ld + t;
      const __m512 z = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row), vscale);
      const __m512 p = exp512(_mm512_sub_ps(z, lse));
      const __m512 inner = _mm512_fmadd_ps(g_ent, _mm512_add_ps(z, shift), g_lp);
      const __m512 dz = _mm512_mul_ps(_mm512_mul_ps(p, inner), _mm512_set1_ps(-scale));
      _mm512_mask_storeu_ps(row, inside, _mm512_maskz_mov_ps(valid, dz));
    }
  }
}

void grad_tile_scalar(float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, GradInputs in) {
  for (int64_t v = 0; v < rows; ++v) {
    float* row = tile + v * ld;
    for (int64_t t = 0; t < cols; ++t) {
      const float z = row[t] * scale;
      const float p = std::exp(z - in.lse[t]);
      row[t] = -scale * p * (in.grad_logprob[t] + in.grad_entropy[t] * (z - in.lse[t] + in.entropy[t]));
    }
    std::fill(row + cols, row + ld, 0.0f);
  }
}

}  // namespace

void fold_tile(const float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, RunningStats stats,
               bool avx512) {
  if (avx512) {
    fold_tile_avx512(tile, rows, cols, ld, scale, stats);
  } else {
    fold_tile_scalar(tile, rows, cols, ld, scale, stats);
  }
}

void exp_tile(float* tile, float* weighted, int64_t rows, int64_t cols, int64_t ld, float scale, const float* max_z,
              bool avx512) {
  if (avx512) {
    exp_tile_avx512(tile, weighted, rows, cols, ld, scale, max_z);
  } else {
    exp_tile_scalar(tile, weighted, rows, cols, ld, scale, max_z);
  }
}

void grad_tile(float* tile, int64_t rows, int64_t cols, int64_t ld, float scale, GradInputs in, bool avx512) {
  if (avx512) {
    grad_tile_avx512(tile, rows, cols, ld, scale, in);
  } else {
    grad_tile_scalar(tile, rows, cols, ld, scale, in);
  }
}

PK_AVX512_BF16 void row_to_bf16_avx512(const float* src, int64_t cols, uint16_t* dst) {
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = lane_mask(cols - c);
    const __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + c));
    _mm256_mask_storeu_epi16(dst + c, m, packed);
  }
}

void to_bf16_both(const float* src, int64_t rows, int64_t cols, int64_t ld, uint16_t* dst, int64_t ld_dst,
                  uint16_t* dst_t, int64_t ld_t) {
  const bool avx512 = gemm::has_bf16_gemm();
  for (int64_t r = 0; r < rows; ++r) {
    if (avx512) {
      row_to_bf16_avx512(src + r * ld, cols, dst + r * ld_dst);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[r * ld_dst + c] = round_to_bf16(src[r * ld + c]);
    }
    std::fill(dst + r * ld_dst + cols, dst + (r + 1) * ld_dst, uint16_t{0});
  }
  if (dst_t == nullptr) return;
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) dst_t[c * ld_t + r] = dst[r * ld_dst + c];
    std::fill(dst_t + c * ld_t + rows, dst_t + (c + 1) * ld_t, uint16_t{0});
  }
}

}  // namespace pykernels::logprobs::cpu
