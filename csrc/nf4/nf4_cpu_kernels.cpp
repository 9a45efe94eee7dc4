// NF4 CPU kernels: a portable scalar path that states the arithmetic, and AVX-512 and AVX2 paths
// that must produce the same bits (compiled with target attributes, chosen at run time).
//
// Arithmetic contract (torch / bitsandbytes 0.50 on CPU, see pykernels/reference/nf4.py):
//   full block:    absmax = max|x| (NaN wins); v = x * (1 / max(absmax, floor))
//   partial block: absmax = max(max|x|, floor);  v = x / absmax
//   v = clamp(v, -1, 1) (NaN stays NaN); code = #{i : !(midpoint[i] >= v)}
// The build uses -ffp-contract=off so no multiply-add is fused behind our back.
#include "nf4/nf4_cpu_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "nf4/nf4_layout.h"

#if defined(__x86_64__)
#include "common/cpu_simd.h"
#endif

namespace pykernels::nf4::cpu {
namespace {

constexpr int64_t kStreamingStoreBytes = int64_t{16} << 20;

// ---------------------------------------------------------------- scalar helpers
template <typename T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

template <typename T>
inline T from_float(float value) {
  return static_cast<T>(value);  // c10::Half / c10::BFloat16: round to nearest even
}

inline float nan_propagating_max(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }
inline float clamp_unit(float v) { return v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v); }

inline uint8_t nf4_code_of(float v) {
  uint8_t code = 0;
  for (float m : kMidpoint) code += !(m >= v);
  return code;
}

inline float block_scale(const BlockScales& s, int64_t block) {
  if (s.absmax != nullptr) return s.absmax[block];
  const float product = s.nested_code[s.absmax_q[block]] * s.nested_absmax[block / s.nested_blocksize];
  return product + *s.nested_offset;
}

// One block of `count` values starting at flat index `begin` (even).
template <typename T>
void quantize_block_scalar(const T* x, int64_t begin, int64_t count, bool partial,
                           uint8_t* packed, float* absmax_out) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < count; ++i) absmax = nan_propagating_max(std::fabs(to_float(x[begin + i])), absmax);
  const float clamped = absmax < kAbsmaxFloor ? kAbsmaxFloor : absmax;  // NaN passes through
  const float reciprocal = 1.0f / clamped;
  *absmax_out = partial ? clamped : absmax;

  uint8_t* out = packed + begin / 2;
  for (int64_t i = 0; i < count; i += 2) {
    uint8_t pair[2] = {kPadCode, kPadCode};
    for (int64_t j = 0; j < 2 && i + j < count; ++j) {
      const float value = to_float(x[begin + i + j]);
      pair[j] = nf4_code_of(clamp_unit(partial ? value / clamped : value * reciprocal));
    }
    out[i / 2] = static_cast<uint8_t>((pair[0] << 4) | pair[1]);
  }
}

// Elements [begin, begin + count) of one block (all scaled by `scale`) into dst[0, count). The
// block's 16 possible outputs are computed and rounded once, then looked up (the same bits as
// converting each element, in a fraction of the work where a block is long).
template <typename T>
void dequantize_values_scalar(const uint8_t* packed, float scale, int64_t begin, int64_t count, T* dst) {
  T table[16];
  for (int code = 0; code < 16; ++code) table[code] = from_float<T>(dequantize_value(kCode[code], scale));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = begin + i;
    dst[i] = table[code_of_element(packed[packed_byte_of(index)], index)];  // the CUDA kernel's decode
  }
}

#if defined(__x86_64__)
// ---------------------------------------------------------------- AVX-512 path
template <typename T>
PK_AVX512 inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// 16 values rounded to a 16-bit type (bf16: nearest even like c10::BFloat16, NaN -> 0x7FC0).
template <typename T>
PK_AVX512 inline __m256i to_16bit(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_to_bf16_x16(v);
  } else {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}

// Stores 32 consecutive values (one or two cache lines). kStream uses non-temporal stores, which
// skip the read-for-ownership of each destination line: a large output then costs one memory
// pass instead of two. They need a 64-byte aligned destination and an sfence before other
// threads read it.
template <typename T, bool kStream>
PK_AVX512 inline void store32(T* dst, __m512 first, __m512 second) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (kStream) {
      _mm512_stream_ps(dst, first);
      _mm512_stream_ps(dst + 16, second);
    } else {
      _mm512_storeu_ps(dst, first);
      _mm512_storeu_ps(dst + 16, second);
    }
  } else {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(to_16bit<T>(first)), to_16bit<T>(second), 1);
    if constexpr (kStream) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), both);
    } else {
      _mm512_storeu_si512(dst, both);
    }
  }
}

// 16 NF4 codes of v by branch-free binary search over the 15 midpoints (lane 15 is +inf and never
// probed). _CMP_NGE_UQ is "!(midpoint >= v)", true for NaN, so NaN ends at 15 like bucketize.
PK_AVX512 inline __m512i nf4_codes16(__m512 v, __m512 midpoints) {
  __m512i code = _mm512_setzero_si512();
  for (int step : {8, 4, 2, 1}) {
    const __m512i probe_index = _mm512_add_epi32(code, _mm512_set1_epi32(step - 1));
    const __m512 probe = _mm512_permutexvar_ps(probe_index, midpoints);
    const __mmask16 below = _mm512_cmp_ps_mask(probe, v, _CMP_NGE_UQ);
    code = _mm512_mask_add_epi32(code, below, code, _mm512_set1_epi32(step));
  }
  return code;
}

// A full block (blocksize % 32 == 0) starting at flat index `begin`.
template <typename T>
PK_AVX512 void quantize_block_avx512(const T* x, int64_t begin, int64_t blocksize,
                                            uint8_t* packed, float* absmax_out) {
  const T* block = x + begin;
  __m512 running_max = _mm512_setzero_ps();
  __mmask16 has_nan = 0;
  for (int64_t i = 0; i < blocksize; i += 16) {
    const __m512 v = load16(block + i);
    has_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    running_max = _mm512_max_ps(running_max, _mm512_abs_ps(v));
  }
  uint8_t* out = packed + begin / 2;
  if (has_nan) {  // torch: NaN absmax, every value scales to NaN, bucketize gives code 15
    *absmax_out = std::numeric_limits<float>::quiet_NaN();
    std::memset(out, 0xFF, blocksize / 2);
    return;
  }
  const float absmax = _mm512_reduce_max_ps(running_max);
  *absmax_out = absmax;
  const __m512 reciprocal = _mm512_set1_ps(1.0f / std::max(absmax, kAbsmaxFloor));
  const __m512 midpoints = _mm512_setr_ps(
      kMidpoint[0], kMidpoint[1], kMidpoint[2], kMidpoint[3], kMidpoint[4], kMidpoint[5],
      kMidpoint[6], kMidpoint[7], kMidpoint[8], kMidpoint[9], kMidpoint[10], kMidpoint[11],
      kMidpoint[12], kMidpoint[13], kMidpoint[14], std::numeric_limits<float>::infinity());
  const __m512 one = _mm512_set1_ps(1.0f), minus_one = _mm512_set1_ps(-1.0f);
  for (int64_t i = 0; i < blocksize; i += 32) {
    __m512i codes[2];
    for (int half = 0; half < 2; ++half) {
      __m512 v = _mm512_mul_ps(load16(block + i + 16 * half), reciprocal);
      // max/min return their second operand when one is NaN: keeps NaN (inf * 0) as NaN.
      v = _mm512_min_ps(one, _mm512_max_ps(minus_one, v));
      codes[half] = nf4_codes16(v, midpoints);
    }
    // 32 codes -> 16-bit lanes (even code low byte, odd code high byte) -> one byte per pair.
    const __m256i bytes = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm512_cvtepi32_epi8(codes[0])), _mm512_cvtepi32_epi8(codes[1]), 1);
    const __m256i high_nibbles = _mm256_and_si256(_mm256_slli_epi16(bytes, 4), _mm256_set1_epi16(0x00F0));
    const __m256i pairs = _mm256_or_si256(high_nibbles, _mm256_srli_epi16(bytes, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm256_cvtepi16_epi8(pairs));
  }
}

// The 32 codes of 16 packed bytes, one a byte, in element order (high nibble first): elements 0-15
// in `first`, 16-31 in `second`. SSE2, which every x86-64 has, so both vector paths inline it.
struct ElementCodes {
  __m128i first, second;
};

inline ElementCodes element_codes(const uint8_t* bytes) {
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), low_mask);
  const __m128i low = _mm_and_si128(raw, low_mask);
  return {_mm_unpacklo_epi8(high, low), _mm_unpackhi_epi8(high, low)};
}

// A full block starting at element `begin` (even) into dst[0, blocksize): 16 products
// code[i] * scale form a lookup table, so each output is exactly the scalar path's fp32 product.
template <typename T, bool kStream>
PK_AVX512 void dequantize_block_avx512(const uint8_t* packed, float scale, int64_t begin,
                                              int64_t blocksize, T* dst) {
  const __m512 table = _mm512_mul_ps(_mm512_loadu_ps(kCode), _mm512_set1_ps(scale));
  const uint8_t* bytes = packed + begin / 2;
  for (int64_t j = 0; j < blocksize / 2; j += 16) {
    const ElementCodes codes = element_codes(bytes + j);
    store32<T, kStream>(dst + 2 * j, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes.first), table),
                        _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes.second), table));
  }
}

// ---------------------------------------------------------------- AVX2 path

template <typename T>
PK_AVX2 inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return widen_bf16_x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// 8 NF4 codes of v (32-bit lanes) as the scalar path counts them: the midpoints m with !(m >= v)
// (_CMP_NGE_UQ, true for NaN, so NaN ends at 15). Fifteen compares, no table: AVX2 permutes only 8
// lanes, and a count is the definition itself.
PK_AVX2 inline __m256i nf4_codes8(__m256 v) {
  __m256i code = _mm256_setzero_si256();
  for (float midpoint : kMidpoint) {  // a true compare is all ones: -1
    code = _mm256_sub_epi32(code, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(midpoint), v, _CMP_NGE_UQ)));
  }
  return code;
}

// quantize_block_avx512 on 8 lanes, the same arithmetic (a full block, blocksize % 32 == 0).
template <typename T>
PK_AVX2 void quantize_block_avx2(const T* x, int64_t begin, int64_t blocksize, uint8_t* packed, float* absmax_out) {
  const T* block = x + begin;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 running_max = _mm256_setzero_ps();
  int has_nan = 0;
  for (int64_t i = 0; i < blocksize; i += 8) {
    const __m256 v = load8(block + i);
    has_nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    running_max = _mm256_max_ps(running_max, _mm256_and_ps(v, magnitude));
  }
  uint8_t* out = packed + begin / 2;
  if (has_nan) {  // as the AVX-512 path: NaN absmax, code 15 everywhere
    *absmax_out = std::numeric_limits<float>::quiet_NaN();
    std::memset(out, 0xFF, blocksize / 2);
    return;
  }
  __m128 max4 = _mm_max_ps(_mm256_castps256_ps128(running_max), _mm256_extractf128_ps(running_max, 1));
  max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
  const float absmax = _mm_cvtss_f32(_mm_max_ss(max4, _mm_shuffle_ps(max4, max4, 1)));
  *absmax_out = absmax;
  const __m256 reciprocal = _mm256_set1_ps(1.0f / std::max(absmax, kAbsmaxFloor));
  const __m256 one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f);
  // Byte pairs: element 2k (low byte of a 16-bit lane) times 16 plus element 2k + 1 (the high byte).
  const __m256i pair_weights = _mm256_set1_epi16(0x0110);
  for (int64_t i = 0; i < blocksize; i += 32) {
    __m256i codes[4];
    for (int q = 0; q < 4; ++q) {
      __m256 v = _mm256_mul_ps(load8(block + i + 8 * q), reciprocal);
      v = _mm256_min_ps(one, _mm256_max_ps(minus_one, v));  // the second operand when one is NaN: NaN stays
      codes[q] = nf4_codes8(v);
    }
    // 32 codes (32-bit lanes) -> 32 bytes: packs and packus work within 128-bit halves, leaving each
    // half's four-code groups interleaved; the permute puts the 32-bit groups back in element order.
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packus_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i pairs = _mm256_maddubs_epi16(bytes, pair_weights);  // 16-bit lanes, each < 256
    const __m256i pair_bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i / 2), _mm256_castsi256_si128(pair_bytes));
  }
}

// 8 codes (32-bit lanes, 0-15) -> table[code]: AVX2 permutes 8 lanes, so the low and high halves
// of the 16-entry table are each looked up and bit 3 of the code (moved to the sign bit) picks one.
PK_AVX2 inline __m256 lookup8(__m256i codes, __m256 table_low, __m256 table_high) {
  const __m256 high_half = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(table_low, codes), _mm256_permutevar8x32_ps(table_high, codes),
                          high_half);
}

// Stores 8 consecutive values; kStream as store32's (non-temporal, 32-byte aligned for fp32, 16 for
// 16-bit types).
template <typename T, bool kStream>
PK_AVX2 inline void store8(T* dst, __m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    if constexpr (kStream) {
      _mm256_stream_ps(dst, v);
    } else {
      _mm256_storeu_ps(dst, v);
    }
  } else {
    const __m128i bits = std::is_same_v<T, c10::BFloat16> ? round_to_bf16_x8(v)
                                                          : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if constexpr (kStream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), bits);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bits);
    }
  }
}

// dequantize_block_avx512 on 8 lanes: the same table of products, so the same bits.
template <typename T, bool kStream>
PK_AVX2 void dequantize_block_avx2(const uint8_t* packed, float scale, int64_t begin, int64_t blocksize, T* dst) {
  const __m256 factor = _mm256_set1_ps(scale);
  const __m256 table_low = _mm256_mul_ps(_mm256_loadu_ps(kCode), factor);
  const __m256 table_high = _mm256_mul_ps(_mm256_loadu_ps(kCode + 8), factor);
  const uint8_t* bytes = packed + begin / 2;
  for (int64_t j = 0; j < blocksize / 2; j += 16) {
    const ElementCodes codes = element_codes(bytes + j);
    const __m128i halves[2] = {codes.first, codes.second};
    for (int h = 0; h < 2; ++h) {
      T* out = dst + 2 * j + 16 * h;
      store8<T, kStream>(out, lookup8(_mm256_cvtepu8_epi32(halves[h]), table_low, table_high));
      store8<T, kStream>(out + 8, lookup8(_mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8)), table_low, table_high));
    }
  }
}

// A full block on the AVX-512 kernel, or else the AVX2 one.
template <typename T, bool kStream>
void dequantize_block_vector(bool avx512, const uint8_t* packed, float scale, int64_t begin, int64_t blocksize,
                             T* dst) {
  if (avx512) {
    dequantize_block_avx512<T, kStream>(packed, scale, begin, blocksize, dst);
  } else {
    dequantize_block_avx2<T, kStream>(packed, scale, begin, blocksize, dst);
  }
}
#endif  // __x86_64__

template <typename T>
void quantize_typed(const QuantizeParams& p, int64_t block_begin, int64_t block_end) {
  const T* x = static_cast<const T*>(p.x);
  const CpuIsa isa = active_cpu_isa();
  const bool avx512 = uses_avx512(isa), avx2 = uses_avx2(isa);
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * p.blocksize;
    const int64_t count = std::min(p.blocksize, p.numel - begin);
    const bool partial = count < p.blocksize;
#if defined(__x86_64__)
    if (avx512 && !partial) {
      quantize_block_avx512(x, begin, p.blocksize, p.packed, p.absmax + b);
      continue;
    }
    if (avx2 && !partial) {
      quantize_block_avx2(x, begin, p.blocksize, p.packed, p.absmax + b);
      continue;
    }
#endif
    quantize_block_scalar(x, begin, count, partial, p.packed, p.absmax + b);
  }
}

template <typename T>
void dequantize_typed(const DequantizeParams& p, int64_t block_begin, int64_t block_end) {
  T* out = static_cast<T*>(p.out);
  const CpuIsa isa = active_cpu_isa();
  const bool avx512 = uses_avx512(isa), avx2 = uses_avx2(isa);
#if defined(__x86_64__)
  // Streaming stores pay off once the output is far larger than the caches (and its consumer
  // will not find it there anyway); below that, keep it cache-resident for the next op.
  const bool stream = (avx512 || avx2) && p.numel * int64_t(sizeof(T)) >= kStreamingStoreBytes &&
                      reinterpret_cast<uintptr_t>(out) % 64 == 0;
#endif
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * p.blocksize;
    const int64_t count = std::min(p.blocksize, p.numel - begin);
    const float scale = block_scale(p.scales, b);
#if defined(__x86_64__)
    if ((avx512 || avx2) && count == p.blocksize) {
      if (stream) {
        dequantize_block_vector<T, true>(avx512, p.packed, scale, begin, p.blocksize, out + begin);
      } else {
        dequantize_block_vector<T, false>(avx512, p.packed, scale, begin, p.blocksize, out + begin);
      }
      continue;
    }
#endif
    dequantize_values_scalar(p.packed, scale, begin, count, out + begin);
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // make the non-temporal stores visible before the op returns
#endif
}

// Elements [begin, end) into dst[0, end - begin): whole blocks take the block path, the partial
// blocks at either end the scalar one. For chunked use (a few weight rows at a time).
template <typename T>
void dequantize_range_typed(const DequantizeParams& p, int64_t begin, int64_t end, T* dst) {
  const CpuIsa isa = active_cpu_isa();
  const bool avx512 = uses_avx512(isa), avx2 = uses_avx2(isa);
  for (int64_t b = begin / p.blocksize; b * p.blocksize < end; ++b) {
    const int64_t block_begin = b * p.blocksize;
    const int64_t first = std::max(begin, block_begin);
    const int64_t last = std::min({end, block_begin + p.blocksize, p.numel});
    const float scale = block_scale(p.scales, b);
#if defined(__x86_64__)
    if ((avx512 || avx2) && first == block_begin && last == block_begin + p.blocksize) {
      dequantize_block_vector<T, false>(avx512, p.packed, scale, first, p.blocksize, dst + (first - begin));
      continue;
    }
#endif
    dequantize_values_scalar(p.packed, scale, first, last - first, dst + (first - begin));
  }
}

}  // namespace

void dequantize_range(const DequantizeParams& p, int64_t begin, int64_t end) {
  switch (p.out_dtype) {
    case DType::kFloat32: return dequantize_range_typed(p, begin, end, static_cast<float*>(p.out));
    case DType::kFloat16: return dequantize_range_typed(p, begin, end, static_cast<c10::Half*>(p.out));
    case DType::kBFloat16: return dequantize_range_typed(p, begin, end, static_cast<c10::BFloat16*>(p.out));
  }
}

void quantize_blocks(const QuantizeParams& p, int64_t block_begin, int64_t block_end) {
  switch (p.x_dtype) {
    case DType::kFloat32: return quantize_typed<float>(p, block_begin, block_end);
    case DType::kFloat16: return quantize_typed<c10::Half>(p, block_begin, block_end);
    case DType::kBFloat16: return quantize_typed<c10::BFloat16>(p, block_begin, block_end);
  }
}

void dequantize_blocks(const DequantizeParams& p, int64_t block_begin, int64_t block_end) {
  switch (p.out_dtype) {
    case DType::kFloat32: return dequantize_typed<float>(p, block_begin, block_end);
    case DType::kFloat16: return dequantize_typed<c10::Half>(p, block_begin, block_end);
    case DType::kBFloat16: return dequantize_typed<c10::BFloat16>(p, block_begin, block_end);
  }
}

std::shared_ptr<const DynamicLut> dynamic_lut(const float* code) {
  // Double quantization always uses the same map, so one or two cached tables serve every call;
  // building one costs 64K steps, as much as quantizing the absmax of a 4096x4096 weight.
  static std::mutex mutex;
  static std::vector<std::pair<std::array<float, 256>, std::shared_ptr<const DynamicLut>>> cache;
  std::array<float, 256> key;
  std::memcpy(key.data(), code, sizeof(key));
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [cached_code, lut] : cache)
    if (std::memcmp(cached_code.data(), key.data(), sizeof(key)) == 0) return lut;

  auto lut = std::make_shared<DynamicLut>();
  float midpoints[255];
  for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
  int below = 0;
  for (int i = 0; i < kDynamicLutSize; ++i) {
    const float grid = (2.0f * static_cast<float>(i)) / static_cast<float>(kDynamicLutSize - 1) - 1.0f;
    while (below < 255 && midpoints[below] < grid) ++below;
    (*lut)[i] = static_cast<uint8_t>(below);
  }
  if (cache.size() >= 4) cache.erase(cache.begin());
  cache.emplace_back(key, lut);
  return lut;
}

void dynamic8_quantize_blocks(const Dynamic8QuantizeParams& p, const uint8_t* lut,
                              int64_t block_begin, int64_t block_end) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    const int64_t begin = b * p.blocksize;
    const int64_t end = std::min(begin + p.blocksize, p.numel);
    const float offset = p.offset != nullptr ? *p.offset : 0.0f;  // x - 0 is x, bit for bit
    const auto value = [&](int64_t i) { return p.x[i] - offset; };
    float absmax = 0.0f;  // bitsandbytes: NaN never wins, and the result is at least 0
    for (int64_t i = begin; i < end; ++i) {
      const float magnitude = std::fabs(value(i));
      if (absmax < magnitude) absmax = magnitude;
    }
    p.absmax[b] = absmax;
    if (absmax == 0.0f) {
      std::memset(p.q + begin, 0, end - begin);
      continue;
    }
    const float reciprocal = 1.0f / absmax;
    for (int64_t i = begin; i < end; ++i) {
      const float v = std::clamp(value(i) * reciprocal, -1.0f, 1.0f);
      // bitsandbytes computes this index with one fused multiply-add, truncates, keeps 16 bits.
      // (Fused or not, the truncated index is the same for every fp32 v: checked exhaustively.)
      const float position = std::fma((v + 1.0f) * 0.5f, static_cast<float>(kDynamicLutSize - 1), 0.5f);
      const int index = std::isnan(position) ? 0 : static_cast<int>(position) & 0xFFFF;
      p.q[i] = lut[index];
    }
  }
}

void dynamic8_dequantize_range(const Dynamic8DequantizeParams& p, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) p.out[i] = p.code[p.q[i]] * p.absmax[i / p.blocksize];
}

}  // namespace pykernels::nf4::cpu
