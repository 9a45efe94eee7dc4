// Shared helpers of the AVX-512 code paths: function target attributes (kernels are compiled for
// several instruction sets and dispatched at run time, see cpu_isa.h) and lane masks.
#pragma once

#include <immintrin.h>

#include <cstdint>

#define PK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define PK_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace pykernels {

// Mask of the first `valid` of 16 lanes (0 and 16 included).
inline __mmask16 lane_mask(int64_t valid) {
  return valid >= 16 ? __mmask16(0xFFFF) : valid <= 0 ? __mmask16(0) : __mmask16((1u << valid) - 1);
}

}  // namespace pykernels
