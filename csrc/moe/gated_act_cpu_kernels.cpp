#include "moe/gated_act_cpu_kernels.h"

#include <immintrin.h>

#include <cstring>

#include "common/cpu_isa.h"
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

// ---------------------------------------------------------------- AVX2: the same math on 8 lanes

// 8 columns from p, of which `valid` exist: a row's last few go through a zero-padded copy, so they
// take the same arithmetic as the rest.
PK_AVX2 inline __m256 load8_bf16(const uint16_t* p, int64_t valid) {
  if (valid >= 8) return widen_bf16_x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t tail[8] = {};
  std::memcpy(tail, p, static_cast<size_t>(valid) * sizeof(uint16_t));
  return widen_bf16_x8(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

PK_AVX2 inline void store8_bf16(uint16_t* p, int64_t valid, __m256 v) {
  const __m128i bits = round_to_bf16_x8(v);
  if (valid >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
    return;
  }
  alignas(16) uint16_t tail[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tail), bits);
  std::memcpy(p, tail, static_cast<size_t>(valid) * sizeof(uint16_t));
}

PK_AVX2 inline __m256 sigmoid8(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

PK_AVX2 void forward_avx2(const uint16_t* gate_up, int64_t row_begin, int64_t row_end, int64_t inner,
                          uint16_t* out) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inner;
    for (int64_t j = 0; j < inner; j += 8) {
      const int64_t valid = inner - j;
      const __m256 g = load8_bf16(gate + j, valid), u = load8_bf16(gate + inner + j, valid);
      store8_bf16(out + r * inner + j, valid, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), u));
    }
  }
}

PK_AVX2 void backward_avx2(const uint16_t* gate_up, const uint16_t* grad_inner, int64_t row_begin,
                           int64_t row_end, int64_t inner, uint16_t* grad_gate_up) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint16_t* gate = gate_up + r * 2 * inner;
    uint16_t* grad = grad_gate_up + r * 2 * inner;
    for (int64_t j = 0; j < inner; j += 8) {
      const int64_t valid = inner - j;
      const __m256 g = load8_bf16(gate + j, valid), u = load8_bf16(gate + inner + j, valid);
      const __m256 dy = load8_bf16(grad_inner + r * inner + j, valid);
      const __m256 s = sigmoid8(g);
      const __m256 slope = _mm256_mul_ps(s, _mm256_add_ps(one, _mm256_mul_ps(g, _mm256_sub_ps(one, s))));
      store8_bf16(grad + j, valid, _mm256_mul_ps(_mm256_mul_ps(dy, u), slope));
      store8_bf16(grad + inner + j, valid, _mm256_mul_ps(dy, _mm256_mul_ps(g, s)));
    }
  }
}

}  // namespace

bool has_silu_gated_bf16() {
  const CpuIsa isa = active_cpu_isa();
  return uses_avx512(isa) || uses_avx2(isa);
}

void silu_gated_bf16(const uint16_t* gate_up, int64_t row_begin, int64_t row_end, int64_t inner, uint16_t* out) {
  if (uses_avx512(active_cpu_isa())) {
    forward_avx512(gate_up, row_begin, row_end, inner, out);
  } else {
    forward_avx2(gate_up, row_begin, row_end, inner, out);
  }
}

void silu_gated_backward_bf16(const uint16_t* gate_up, const uint16_t* grad_inner, int64_t row_begin,
                              int64_t row_end, int64_t inner, uint16_t* grad_gate_up) {
  if (uses_avx512(active_cpu_isa())) {
    backward_avx512(gate_up, grad_inner, row_begin, row_end, inner, grad_gate_up);
  } else {
    backward_avx2(gate_up, grad_inner, row_begin, row_end, inner, grad_gate_up);
  }
}

}  // namespace pykernels::moe::cpu
