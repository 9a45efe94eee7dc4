#include "moe/moe_cpu_kernels.h"

#include <immintrin.h>

#include <algorithm>

#include "common/cpu_simd.h"

namespace pykernels::moe::cpu {
namespace {

// 16 slots x 16 features at a time: 16 tile rows loaded (one feature, 16 slots each), transposed
// through a small buffer, each slot's 16 features rounded and stored at once.
PK_AVX512_BF16 void store_transposed_avx512(const float* tile, int64_t ld, int64_t rows, int64_t cols,
                                            const float* gates, uint16_t* dst, const int64_t* dst_rows,
                                            int64_t ld_dst) {
  alignas(64) float block[16][16];
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, cols - j0);
    const __mmask16 slots = lane_mask(nj);
    const __m512 gate = gates ? _mm512_maskz_loadu_ps(slots, gates + j0) : _mm512_set1_ps(1.0f);
    for (int64_t o0 = 0; o0 < rows; o0 += 16) {
      const int64_t no = std::min<int64_t>(16, rows - o0);
      for (int64_t o = 0; o < no; ++o) {
        _mm512_store_ps(block[o], _mm512_mul_ps(gate, _mm512_maskz_loadu_ps(slots, tile + (o0 + o) * ld + j0)));
      }
      for (int64_t j = 0; j < nj; ++j) {
        alignas(64) float column[16];
        for (int64_t o = 0; o < 16; ++o) column[o] = block[o][j];
        const __mmask16 features = lane_mask(no);
        const __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(column));
        _mm256_mask_storeu_epi16(dst + dst_rows[j0 + j] * ld_dst + o0, features, packed);
      }
    }
  }
}

PK_AVX512_BF16 void sum_slots_avx512(const uint16_t* rows, const int64_t* slot_of, int64_t top_k, int64_t n,
                                     uint16_t* out) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = lane_mask(n - c);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < top_k; ++j) {
      if (slot_of[j] < 0) continue;
      const __m256i v = _mm256_maskz_loadu_epi16(m, rows + slot_of[j] * n + c);
      sum = _mm512_add_ps(sum, widen_bf16(v));
    }
    _mm256_mask_storeu_epi16(out + c, m, (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

PK_AVX512_BF16 void gate_rows_avx512(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* gates,
                                     const uint16_t* x, const int64_t* x_offsets, float* dgate, uint16_t* dst,
                                     const int64_t* dst_rows, int64_t ld_dst) {
  for (int64_t j = 0; j < rows; ++j) {
    const float* row = c + j * ldc;
    const __m512 gate = _mm512_set1_ps(gates ? gates[j] : 1.0f);
    __m512 dot = _mm512_setzero_ps();
    for (int64_t k = 0; k < cols; k += 16) {
      const __mmask16 m = lane_mask(cols - k);
      const __m512 v = _mm512_maskz_loadu_ps(m, row + k);
      if (dgate) {
        const __m256i xb = _mm256_maskz_loadu_epi16(m, x + x_offsets[j] + k);
        dot = _mm512_fmadd_ps(v, widen_bf16(xb), dot);
      }
      _mm256_mask_storeu_epi16(dst + dst_rows[j] * ld_dst + k, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(gate, v)));
    }
    if (dgate) dgate[j] = _mm512_reduce_add_ps(dot);
  }
}

}  // namespace

void gate_rows_bf16(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* gates, const uint16_t* x,
                    const int64_t* x_offsets, float* dgate, uint16_t* dst, const int64_t* dst_rows, int64_t ld_dst) {
  gate_rows_avx512(c, ldc, rows, cols, gates, x, x_offsets, dgate, dst, dst_rows, ld_dst);
}

void store_transposed_bf16(const float* tile, int64_t ld, int64_t rows, int64_t cols, const float* gates,
                           uint16_t* dst, const int64_t* dst_rows, int64_t ld_dst) {
  store_transposed_avx512(tile, ld, rows, cols, gates, dst, dst_rows, ld_dst);
}

void sum_slots_bf16(const uint16_t* rows, const int64_t* slot_of, int64_t tokens, int64_t top_k, int64_t n,
                    uint16_t* out) {
  for (int64_t t = 0; t < tokens; ++t) sum_slots_avx512(rows, slot_of + t * top_k, top_k, n, out + t * n);
}

}  // namespace pykernels::moe::cpu
