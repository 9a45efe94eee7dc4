// Shared helpers of the AVX-512 code paths: function target attributes (kernels are compiled for
// several instruction sets and dispatched at run time, see cpu_isa.h), lane masks and bf16 conversions.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define PK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define PK_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace pykernels {

// Mask of the first `valid` of 16 lanes (0 and 16 included).
inline __mmask16 lane_mask(int64_t valid) {
  return valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

// 16 bf16 values -> fp32, exactly: a bf16 is the upper half of the fp32 with the same value.
PK_AVX512 inline __m512 widen_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// bf16 bits -> fp32, exactly.
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

// fp32 -> bf16 bits, round to nearest even (as vcvtneps2bf16); NaN stays NaN.
inline uint16_t round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// exp(x): Cephes' expf polynomial, ~1 ulp; -inf and anything below -104 give 0, above ~88.7 +inf.
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

// 16 values rounded to bf16 (nearest even, NaN -> 0x7FC0, as c10::BFloat16), as 16-bit lanes; for
// CPUs without AVX-512 BF16's vcvtneps2bf16.
PK_AVX512 inline __m256i round_to_bf16_x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

}  // namespace pykernels
