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

}  // namespace pykernels
