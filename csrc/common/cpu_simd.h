// Shared helpers of the AVX2 and AVX-512 code paths: function target attributes (kernels are compiled
// for several instruction sets and dispatched at run time, see cpu_isa.h), lane masks, bf16
// conversions and exp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define PK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define PK_AVX2 __attribute__((target("avx2,fma,f16c")))
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

// ---------------------------------------------------------------- AVX2 (8 fp32 lanes)

// 8 bf16 values -> fp32, exactly.
PK_AVX2 inline __m256 widen_bf16_x8(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// 8 values rounded to bf16 as round_to_bf16_x16 does (nearest even, NaN -> 0x7FC0), as 16-bit lanes.
PK_AVX2 inline __m128i round_to_bf16_x8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // 32-bit lanes (each < 2^16) -> 16-bit: packus works within 128-bit halves, so gather the two
  // halves' results (quadwords 0 and 2) into the low 128 bits.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  return _mm256_castsi256_si128(packed);
}

// 2^e for integer lanes e in [-126, 127].
PK_AVX2 inline __m256 power_of_two_x8(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}

// exp512's polynomial on 8 lanes. AVX2 has no scalef: 2^n is applied as two powers of two, each a
// normal float for n in [-150, 128], so results underflow to subnormals and 0 and overflow to +inf
// as scalef's do. NaN becomes -104 in the first max (as in exp512), so exp(NaN) is 0.
PK_AVX2 inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(whole, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, power_of_two_x8(half)), power_of_two_x8(_mm256_sub_epi32(whole, half)));
}

}  // namespace pykernels
