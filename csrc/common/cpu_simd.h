// Shared helpers of the AVX-512 code paths: function target attributes (kernels are compiled for
// several instruction sets and dispatched at run time, see cpu_isa.h) and lane masks.
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

// fp32 -> bf16 bits, round to nearest even (as vcvtneps2bf16); NaN stays NaN.
inline uint16_t round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace pykernels
