#include "common/cpu_gemm_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "common/cpu_gemm_amx.h"
#include "common/cpu_isa.h"
#include "common/cpu_simd.h"

namespace pykernels::gemm {
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

// One panel of pack_transposed_gather with AVX-512 gathers: for each pair q, the 32-bit words at
// element 2q of the panel's rows (element offsets fit in int32; scale 2 reads bf16 pairs at any
// alignment). Only full pairs; the caller handles an odd K's last element.
PK_AVX512 void gather_panel_avx512(const uint16_t* base, const int64_t* row_offsets, int64_t width, int64_t pairs,
                                   uint32_t* out) {
  __m512i idx[2];
  __mmask16 valid[2];
  for (int half = 0; half < 2; ++half) {
    alignas(64) int32_t offsets[16];
    for (int j = 0; j < 16; ++j) {
      const int64_t c = 16 * half + j;
      offsets[j] = c < width ? static_cast<int32_t>(row_offsets[c]) : 0;
    }
    idx[half] = _mm512_load_si512(offsets);
    valid[half] = lane_mask(width - 16 * half);
  }
  const __m512i two = _mm512_set1_epi32(2);
  for (int64_t q = 0; q < pairs; ++q) {
    for (int half = 0; half < 2; ++half) {
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid[half], idx[half], base, 2);
      _mm512_storeu_si512(out + q * kPanel + 16 * half, words);
      idx[half] = _mm512_add_epi32(idx[half], two);
    }
  }
}

void pack_transposed_gather(const uint16_t* base, const int64_t* row_offsets, int64_t cols, int64_t k,
                            uint32_t* dst) {
  const int64_t full_pairs = k / 2, all_pairs = (k + 1) / 2;
  bool small = true;  // gathers take int32 offsets
  for (int64_t c = 0; c < cols; ++c) small = small && row_offsets[c] + k < (int64_t{1} << 31);
  const bool avx512 = has_bf16_gemm() && small;
  for (int64_t p = 0; p < panels(cols); ++p) {
    uint32_t* out = dst + p * panel_stride(k);
    const int64_t width = std::min(kPanel, cols - p * kPanel);
    const int64_t* offsets = row_offsets + p * kPanel;
    const int64_t vector_pairs = avx512 ? full_pairs : 0;
    if (avx512) gather_panel_avx512(base, offsets, width, full_pairs, out);
    for (int64_t q = vector_pairs; q < all_pairs; ++q) {
      for (int64_t j = 0; j < kPanel; ++j) {
        uint32_t lo = 0, hi = 0;
        if (j < width) {
          lo = base[offsets[j] + 2 * q];
          hi = 2 * q + 1 < k ? base[offsets[j] + 2 * q + 1] : 0;
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
  // Pairs of rows outer, panels inner: each row is read once, as one run of `cols` elements. Panel by
  // panel, a block of 128 columns of a [7168, 4096] weight read 64 bytes per row four times over and
  // ran at ~2.4 GB/s (a DRAM page and a TLB entry per 64 bytes), the most of the MoE backward on AMX.
  for (int64_t q = 0; q < pairs; ++q) {
    for (int64_t p = 0; p < panels(cols); ++p) {
      uint32_t* out = dst + p * panel_stride(k_padded);
      const int64_t width = std::min(kPanel, cols - p * kPanel);
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

namespace {

// gemm_bf16 on the AVX-512 BF16 micro-kernel alone.
void gemm_avx512(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint32_t* b,
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

// The tiles run where the cpu isa is "amx" and K has a whole step of 32 for them.
bool tiles_run(int64_t k) { return active_cpu_isa() == CpuIsa::kAmx && amx_pairs(k) > 0; }

}  // namespace

int64_t prepacked_a_size(int64_t m, int64_t k) { return tiles_run(k) ? amx_packed_a_size(m, k) : 0; }

void prepack_a(const uint16_t* a, int64_t lda, int64_t m, int64_t k, uint16_t* dst) {
  if (tiles_run(k)) amx_pack_a(a, lda, m, k, dst);
}

void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* a_prepacked,
               const uint32_t* b, int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate) {
  if (!tiles_run(k) || m == 0 || n == 0) {  // a_prepacked unused (the isa may have changed since)
    gemm_avx512(m, n, k, a, lda, b, b_panel_stride, c, ldc, accumulate);
    return;
  }
  // The tiles take K in steps of 32 over all of C (partial tiles through copies: on AVX-512 a partial
  // last panel of a few columns cost as much as eight whole ones on the tiles), AVX-512 the rest of K.
  const int64_t pairs = amx_pairs(k);
  gemm_bf16_amx(m, n, k, a, lda, a_prepacked, b, b_panel_stride, c, ldc, accumulate);
  if (2 * pairs < k) {
    gemm_avx512(m, n, k - 2 * pairs, a + 2 * pairs, lda, b + pairs * kPanel, b_panel_stride, c, ldc, true);
  }
}

void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint32_t* b,
               int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate) {
  gemm_bf16(m, n, k, a, lda, nullptr, b, b_panel_stride, c, ldc, accumulate);
}

}  // namespace pykernels::gemm
