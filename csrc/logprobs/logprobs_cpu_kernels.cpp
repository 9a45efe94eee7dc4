#include "logprobs/logprobs_cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#define PK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define PK_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace pykernels::logprobs::cpu {
namespace {

// Micro-tile: kRows rows of C by kPanel columns, 2 x kRows fp32 accumulators (24 of the 32 zmm).
constexpr int kRows = 12;
// Pairs of K per cache block: a B panel block is kKPairs x kPanel x 4 bytes = 32 KiB (stays in L1
// while the micro-kernel walks the rows of A). Operands and C should be 64-byte aligned: a vector
// load or store across two cache lines costs ~20% of the throughput.
constexpr int64_t kKPairs = 256;

inline uint32_t load_pair(const uint16_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// C[kRows' x 32] (+)= A[., 2 * pairs (+1 if odd)] B. Template row count: the accumulators stay in
// registers only when the loops over them unroll fully at compile time.
template <int R>
PK_AVX512_BF16 void micro_kernel(int64_t pairs, bool odd, const uint16_t* a, int64_t lda, const uint32_t* b,
                                 float* c, int64_t ldc, bool accumulate, __mmask16 lo, __mmask16 hi) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    acc0[i] = accumulate ? _mm512_maskz_loadu_ps(lo, c + i * ldc) : _mm512_setzero_ps();
    acc1[i] = accumulate ? _mm512_maskz_loadu_ps(hi, c + i * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + q * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + q * kPanel + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(a + i * lda + 2 * q)));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], av, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], av, b1);
    }
  }
  if (odd) {  // last element of an odd K: its pair partner in B is zero, and A is not read past K
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + pairs * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + pairs * kPanel + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(a[i * lda + 2 * pairs]);
      acc0[i] = _mm512_dpbf16_ps(acc0[i], av, b0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], av, b1);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_mask_storeu_ps(c + i * ldc, lo, acc0[i]);
    _mm512_mask_storeu_ps(c + i * ldc + 16, hi, acc1[i]);
  }
}

using MicroKernel = void (*)(int64_t, bool, const uint16_t*, int64_t, const uint32_t*, float*, int64_t, bool,
                             __mmask16, __mmask16);

template <int... R>
constexpr auto make_kernels(std::integer_sequence<int, R...>) {
  return std::array<MicroKernel, sizeof...(R)>{&micro_kernel<R + 1>...};
}
// kernels[r - 1] handles r rows: the full tile and every row tail.
constexpr auto kKernels = make_kernels(std::make_integer_sequence<int, kRows>{});

inline __mmask16 lane_mask(int64_t valid) {
  return valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

// exp for x <= ~0 (log-softmax arguments): Cephes' expf polynomial, ~1 ulp; -inf and anything
// below -104 give 0.
PK_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

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

inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN stays NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);                   // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

bool has_bf16_gemm() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void pack_transposed(const uint16_t* src, int64_t cols, int64_t k, int64_t ld, uint32_t* dst) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t p = 0; p < panels(cols); ++p) {
    uint32_t* out = dst + p * panel_stride(k);
    for (int64_t q = 0; q < pairs; ++q) {
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t c = p * kPanel + j;
        uint32_t lo = 0, hi = 0;
        if (c < cols) {
          lo = src[c * ld + 2 * q];
          hi = 2 * q + 1 < k ? src[c * ld + 2 * q + 1] : 0;
        }
        out[q * kPanel + j] = lo | (hi << 16);
      }
    }
  }
}

// Full 32-column panels of pack_rows, 16 pairs per instruction group: zero-extend each row's
// bf16 to 32 bits and put row 2q + 1 in the high halves.
PK_AVX512 void pack_rows_avx512(const uint16_t* r0, const uint16_t* r1, uint32_t* out) {
  for (int half = 0; half < 2; ++half) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 16 * half)));
    const __m512i hi = r1 == nullptr ? _mm512_setzero_si512()
                                     : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(r1 + 16 * half))), 16);
    _mm512_storeu_si512(out + 16 * half, _mm512_or_si512(lo, hi));
  }
}

void pack_rows(const uint16_t* src, int64_t k, int64_t k_padded, int64_t cols, int64_t ld, uint32_t* dst) {
  const bool avx512 = has_bf16_gemm();
  const int64_t pairs = (k_padded + 1) / 2;
  for (int64_t p = 0; p < panels(cols); ++p) {
    uint32_t* out = dst + p * panel_stride(k_padded);
    const int64_t width = std::min(kPanel, cols - p * kPanel);
    for (int64_t q = 0; q < pairs; ++q) {
      const uint16_t* r0 = 2 * q < k ? src + 2 * q * ld + p * kPanel : nullptr;
      const uint16_t* r1 = 2 * q + 1 < k ? src + (2 * q + 1) * ld + p * kPanel : nullptr;
      if (avx512 && r0 != nullptr && width == kPanel) {
        pack_rows_avx512(r0, r1, out + q * kPanel);
        continue;
      }
      for (int64_t j = 0; j < kPanel; ++j) {
        const uint32_t lo = r0 && j < width ? r0[j] : 0, hi = r1 && j < width ? r1[j] : 0;
        out[q * kPanel + j] = lo | (hi << 16);
      }
    }
  }
}

void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint32_t* b,
               int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate) {
  const int64_t full_pairs = k / 2, all_pairs = (k + 1) / 2;
  for (int64_t q0 = 0; q0 < std::max<int64_t>(all_pairs, 1); q0 += kKPairs) {
    const int64_t q1 = std::min(all_pairs, q0 + kKPairs);
    const int64_t pairs = std::min(q1, full_pairs) - q0;
    const bool odd = (k % 2 == 1) && q1 == all_pairs;
    const bool acc = accumulate || q0 > 0;
    for (int64_t p = 0; p < panels(n); ++p) {
      const int64_t width = std::min(kPanel, n - p * kPanel);
      const __mmask16 lo = lane_mask(width), hi = lane_mask(width - 16);
      const uint32_t* bp = b + p * b_panel_stride + q0 * kPanel;
      for (int64_t i = 0; i < m; i += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - i);
        {  // C rows of the next call (read, or written whole): ldc apart, so no hardware prefetcher sees them
          for (int64_t r = i + kRows; r < std::min(m, i + 2 * kRows); ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + p * kPanel), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(c + r * ldc + p * kPanel + 16), _MM_HINT_T0);
          }
        }
        kKernels[rows - 1](pairs, odd, a + i * lda + 2 * q0, lda, bp, c + i * ldc + p * kPanel, ldc, acc, lo, hi);
      }
    }
  }
}

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
  const bool avx512 = has_bf16_gemm();
  for (int64_t r = 0; r < rows; ++r) {
    if (avx512) {
      row_to_bf16_avx512(src + r * ld, cols, dst + r * ld_dst);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[r * ld_dst + c] = to_bf16(src[r * ld + c]);
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
