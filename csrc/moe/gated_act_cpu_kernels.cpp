#include "moe/gated_act_cpu_kernels.h"

#include <immintrin.h>

#include "common/cpu_simd.h"

namespace pykernels::moe::cpu {
namespace {

PK_AVX512 inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

PK_AVX512 inline void store_bf16(uint16_t* p, __mmask16 m, __m512 v) {
  _mm256_mask_storeu_epi16(p, m, round_to_bf16_x16(v));
}

PK_AVX512 inline __m512 sigmoid16(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

PK_AVX512 void forward_avx512(const uint16_t* gate_up, int64_t row_begin, int64_t row_end, int64_t inner,
                              uint16_t* out) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inner;
    for (int64_t j = 0; j < inner; j += 16) {
      const __mmask16 m = lane_mask(inner - j);
      const __m512 g = load_bf16(gate + j, m), u = load_bf16(gate + inner + j, m);
      store_bf16(out + r * inner + j, m, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid16(g)), u));
    }
  }
}

PK_AVX512 void backward_avx512(const uint16_t* gate_up, const uint16_t* grad_inner, int64_t row_begin,
                               int64_t row_end, int64_t inner, uint16_t* grad_gate_up) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inner;
    uint16_t* grad = grad_gate_up + r * 2 * inner;
    for (int64_t j = 0; j < inner; j += 16) {
      const __mmask16 m = lane_mask(inner - j);
      const __m512 g = load_bf16(gate + j, m), u = load_bf16(gate + inner + j, m);
      const __m512 dy = load_bf16(grad_inner + r * inner + j, m);
      const __m512 s = sigmoid16(g);
      // d gate = dy u s (1 + g (1 - s)), d up = dy g s
      const __m512 slope = _mm512_mul_ps(s, _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, s))));
      store_bf16(grad + j, m, _mm512_mul_ps(_mm512_mul_ps(dy, u), slope));
      store_bf16(grad + inner + j, m, _mm512_mul_ps(dy, _mm512_mul_ps(g, s)));
    }
  }
}

}  // namespace

void silu_gated_bf16(const uint16_t* gate_up, int64_t row_begin, int64_t row_end, int64_t inner, uint16_t* out) {
  forward_avx512(gate_up, row_begin, row_end, inner, out);
}

void silu_gated_backward_bf16(const uint16_t* gate_up, const uint16_t* grad_inner, int64_t row_begin,
                              int64_t row_end, int64_t inner, uint16_t* grad_gate_up) {
  backward_avx512(gate_up, grad_inner, row_begin, row_end, inner, grad_gate_up);
}

}  // namespace pykernels::moe::cpu
