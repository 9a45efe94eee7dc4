// LoRA rank-r CPU kernels (see lora_cpu_kernels.h): fp32 in, fp32 out, broadcast-FMA inner loops.
#include "lora/lora_cpu_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "common/cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define PYKERNELS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#endif

namespace pykernels::lora::cpu {
namespace {

constexpr int kLanes = 16;       // fp32 lanes of a 512-bit vector
constexpr int kMaxVectors = 4;   // r handled in chunks of 64 lanes: 4 accumulators per row
constexpr int kDownRows = 4;     // rows sharing each load of A^T in low_rank_down
constexpr int kUpRows = 4;       // rows sharing each load of B^T in low_rank_up
constexpr int kBackwardRows = 2; // rows sharing each read-modify-write of dB
constexpr int kAGradRows = 4;    // rows sharing each read-modify-write of dA
constexpr int64_t kDownTile = 256;   // k per tile of A^T in low_rank_down (256 x r fp32)
constexpr int64_t kColumnTile = 128; // output / dA columns per tile (r x 128 fp32 of B^T or dA)
constexpr int64_t kRowTile = 128;    // rows of dB per tile in low_rank_backward (128 x r fp32)

// ---------------------------------------------------------------- portable versions
void down_scalar(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < r; ++j) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) sum += x[i * k + kk] * a_t[kk * r + j];
      xa[i * r + j] = sum;
    }
}

void up_scalar(float* out, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt, const float* bias) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < n; ++c) {
      float sum = out[i * n + c] + (bias != nullptr ? bias[c] : 0.0f);
      for (int64_t j = 0; j < r; ++j) sum += xa[i * r + j] * bt[j * n + c];
      out[i * n + c] = sum;
    }
}

void backward_scalar(const float* dy, int64_t rows, int64_t n, const float* b, const float* xa, int64_t r, float scale,
                     float* dxa, float* db) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < r; ++j) dxa[i * r + j] = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      const float g = scale * dy[i * n + c];
      for (int64_t j = 0; j < r; ++j) {
        dxa[i * r + j] += g * b[c * r + j];
        db[c * r + j] += g * xa[i * r + j];
      }
    }
  }
}

void a_grad_scalar(const float* x, int64_t rows, int64_t k, const float* dxa, int64_t r, float* da) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < r; ++j) {
      const float d = dxa[i * r + j];
      for (int64_t kk = 0; kk < k; ++kk) da[j * k + kk] += d * x[i * k + kk];
    }
}

#if defined(__x86_64__)
// ---------------------------------------------------------------- AVX-512 versions
// Every kernel walks the long dimension in tiles and, within a tile, all rows of its block: the
// tile of A^T / B^T / dB / dA it reads and writes (r x 128..256 fp32, up to 64 KiB) then stays in
// L1/L2 across the rows instead of streaming from memory once per row group.
PYKERNELS_AVX512 inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

// xa rows [0, kRows) of lanes [c0, c0 + 16 * vectors), over k in [k0, k1): accumulated onto xa
// unless `first`.
template <int kRows>
PYKERNELS_AVX512 void down_block(const float* x, int64_t k, int64_t k0, int64_t k1, const float* a_t, int64_t r,
                                 int64_t c0, int vectors, bool first, float* xa) {
  __m512 acc[kRows][kMaxVectors];
  __mmask16 mask[kMaxVectors];
  for (int v = 0; v < vectors; ++v) {
    mask[v] = tail_mask(r - c0 - v * kLanes);
    for (int i = 0; i < kRows; ++i)
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], xa + i * r + c0 + v * kLanes);
  }
  for (int64_t kk = k0; kk < k1; ++kk) {
    __m512 a[kMaxVectors];
    for (int v = 0; v < vectors; ++v) a[v] = _mm512_maskz_loadu_ps(mask[v], a_t + kk * r + c0 + v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * k + kk]);
      for (int v = 0; v < vectors; ++v) acc[i][v] = _mm512_fmadd_ps(xv, a[v], acc[i][v]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < vectors; ++v) _mm512_mask_storeu_ps(xa + i * r + c0 + v * kLanes, mask[v], acc[i][v]);
}

PYKERNELS_AVX512 void down_avx512(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
  for (int64_t c0 = 0; c0 < r; c0 += kMaxVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kMaxVectors, (r - c0 + kLanes - 1) / kLanes));
    for (int64_t k0 = 0; k0 < k; k0 += kDownTile) {
      const int64_t k1 = std::min(k, k0 + kDownTile);
      int64_t i = 0;
      for (; i + kDownRows <= rows; i += kDownRows)
        down_block<kDownRows>(x + i * k, k, k0, k1, a_t, r, c0, vectors, k0 == 0, xa + i * r);
      for (; i < rows; ++i) down_block<1>(x + i * k, k, k0, k1, a_t, r, c0, vectors, k0 == 0, xa + i * r);
    }
  }
}

// Columns [c0, c1) of rows [0, kRows).
template <int kRows>
PYKERNELS_AVX512 void up_block(float* out, int64_t n, int64_t c0, int64_t c1, const float* xa, int64_t r,
                               const float* bt, const float* bias) {
  for (int64_t c = c0; c < c1; c += kLanes) {
    const __mmask16 mask = tail_mask(c1 - c);
    const __m512 bias_v = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    __m512 acc[kRows];
    for (int i = 0; i < kRows; ++i) acc[i] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out + i * n + c), bias_v);
    for (int64_t j = 0; j < r; ++j) {
      const __m512 b = _mm512_maskz_loadu_ps(mask, bt + j * n + c);
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xa[i * r + j]), b, acc[i]);
    }
    for (int i = 0; i < kRows; ++i) _mm512_mask_storeu_ps(out + i * n + c, mask, acc[i]);
  }
}

PYKERNELS_AVX512 void up_avx512(float* out, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt,
                                const float* bias) {
  for (int64_t c0 = 0; c0 < n; c0 += kColumnTile) {
    const int64_t c1 = std::min(n, c0 + kColumnTile);
    int64_t i = 0;
    for (; i + kUpRows <= rows; i += kUpRows) up_block<kUpRows>(out + i * n, n, c0, c1, xa + i * r, r, bt, bias);
    for (; i < rows; ++i) up_block<1>(out + i * n, n, c0, c1, xa + i * r, r, bt, bias);
  }
}

// dy rows [0, kRows), columns [n0, n1), lanes [c0, c0 + 16 * vectors) of r; dxa accumulated unless `first`.
template <int kRows>
PYKERNELS_AVX512 void backward_block(const float* dy, int64_t n, int64_t n0, int64_t n1, const float* b,
                                     const float* xa, int64_t r, int64_t c0, int vectors, float scale, bool first,
                                     float* dxa, float* db) {
  __m512 grad[kRows][kMaxVectors], xa_v[kRows][kMaxVectors];
  __mmask16 mask[kMaxVectors];
  for (int v = 0; v < vectors; ++v) {
    mask[v] = tail_mask(r - c0 - v * kLanes);
    for (int i = 0; i < kRows; ++i) {
      grad[i][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], dxa + i * r + c0 + v * kLanes);
      xa_v[i][v] = _mm512_maskz_loadu_ps(mask[v], xa + i * r + c0 + v * kLanes);
    }
  }
  for (int64_t c = n0; c < n1; ++c) {
    __m512 g[kRows];
    for (int i = 0; i < kRows; ++i) g[i] = _mm512_set1_ps(scale * dy[i * n + c]);
    for (int v = 0; v < vectors; ++v) {
      const __m512 bv = _mm512_maskz_loadu_ps(mask[v], b + c * r + c0 + v * kLanes);
      __m512 dbv = _mm512_maskz_loadu_ps(mask[v], db + c * r + c0 + v * kLanes);
      for (int i = 0; i < kRows; ++i) {
        grad[i][v] = _mm512_fmadd_ps(g[i], bv, grad[i][v]);
        dbv = _mm512_fmadd_ps(g[i], xa_v[i][v], dbv);
      }
      _mm512_mask_storeu_ps(db + c * r + c0 + v * kLanes, mask[v], dbv);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int v = 0; v < vectors; ++v) _mm512_mask_storeu_ps(dxa + i * r + c0 + v * kLanes, mask[v], grad[i][v]);
}

PYKERNELS_AVX512 void backward_avx512(const float* dy, int64_t rows, int64_t n, const float* b, const float* xa,
                                      int64_t r, float scale, float* dxa, float* db) {
  for (int64_t c0 = 0; c0 < r; c0 += kMaxVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kMaxVectors, (r - c0 + kLanes - 1) / kLanes));
    for (int64_t n0 = 0; n0 < n; n0 += kRowTile) {
      const int64_t n1 = std::min(n, n0 + kRowTile);
      int64_t i = 0;
      for (; i + kBackwardRows <= rows; i += kBackwardRows)
        backward_block<kBackwardRows>(dy + i * n, n, n0, n1, b, xa + i * r, r, c0, vectors, scale, n0 == 0,
                                      dxa + i * r, db);
      for (; i < rows; ++i)
        backward_block<1>(dy + i * n, n, n0, n1, b, xa + i * r, r, c0, vectors, scale, n0 == 0, dxa + i * r, db);
    }
  }
}

// Columns [c0, c1) of dA from rows [0, kRows) of x.
template <int kRows>
PYKERNELS_AVX512 void a_grad_block(const float* x, int64_t k, int64_t c0, int64_t c1, const float* dxa, int64_t r,
                                   float* da) {
  for (int64_t c = c0; c < c1; c += kLanes) {
    const __mmask16 mask = tail_mask(c1 - c);
    __m512 xv[kRows];
    for (int i = 0; i < kRows; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * k + c);
    for (int64_t j = 0; j < r; ++j) {
      __m512 acc = _mm512_maskz_loadu_ps(mask, da + j * k + c);
      for (int i = 0; i < kRows; ++i) acc = _mm512_fmadd_ps(_mm512_set1_ps(dxa[i * r + j]), xv[i], acc);
      _mm512_mask_storeu_ps(da + j * k + c, mask, acc);
    }
  }
}

PYKERNELS_AVX512 void a_grad_avx512(const float* x, int64_t rows, int64_t k, const float* dxa, int64_t r, float* da) {
  for (int64_t c0 = 0; c0 < k; c0 += kColumnTile) {
    const int64_t c1 = std::min(k, c0 + kColumnTile);
    int64_t i = 0;
    for (; i + kAGradRows <= rows; i += kAGradRows) a_grad_block<kAGradRows>(x + i * k, k, c0, c1, dxa + i * r, r, da);
    for (; i < rows; ++i) a_grad_block<1>(x + i * k, k, c0, c1, dxa + i * r, r, da);
  }
}
#endif  // __x86_64__

bool use_avx512() { return active_cpu_isa() == CpuIsa::kAvx512; }

#if defined(__x86_64__)
PYKERNELS_AVX512 void bf16_to_fp32_avx512(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 mask = tail_mask(count - i);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, src + i);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
  }
}

PYKERNELS_AVX512 void fp32_to_bf16_avx512(const float* src, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {  // round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16)
    const __mmask16 mask = tail_mask(count - i);
    const __m512 v = _mm512_maskz_loadu_ps(mask, src + i);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(dst + i, mask, _mm512_cvtepi32_epi16(rounded));
  }
}

PYKERNELS_AVX512 void fp16_to_fp32_avx512(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 mask = tail_mask(count - i);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src + i)));
  }
}

PYKERNELS_AVX512 void fp32_to_fp16_avx512(const float* src, int64_t count, uint16_t* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 mask = tail_mask(count - i);
    const __m256i half = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(mask, src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(dst + i, mask, half);
  }
}
#endif

}  // namespace

void to_fp32(const void* src, DType src_dtype, int64_t count, float* dst) {
  if (src_dtype == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(src);
#if defined(__x86_64__)
  if (use_avx512()) {
    return src_dtype == DType::kBFloat16 ? bf16_to_fp32_avx512(bits, count, dst) : fp16_to_fp32_avx512(bits, count, dst);
  }
#endif
  for (int64_t i = 0; i < count; ++i)
    dst[i] = src_dtype == DType::kBFloat16 ? static_cast<float>(static_cast<const c10::BFloat16*>(src)[i])
                                           : static_cast<float>(static_cast<const c10::Half*>(src)[i]);
}

void from_fp32(const float* src, int64_t count, void* dst, DType dst_dtype) {
  if (dst_dtype == DType::kFloat32) {
    std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  auto* bits = static_cast<uint16_t*>(dst);
#if defined(__x86_64__)
  if (use_avx512()) {
    return dst_dtype == DType::kBFloat16 ? fp32_to_bf16_avx512(src, count, bits) : fp32_to_fp16_avx512(src, count, bits);
  }
#endif
  for (int64_t i = 0; i < count; ++i) {
    if (dst_dtype == DType::kBFloat16) {
      static_cast<c10::BFloat16*>(dst)[i] = c10::BFloat16(src[i]);
    } else {
      static_cast<c10::Half*>(dst)[i] = c10::Half(src[i]);
    }
  }
}

void low_rank_down(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
#if defined(__x86_64__)
  if (use_avx512()) return down_avx512(x, rows, k, a_t, r, xa);
#endif
  down_scalar(x, rows, k, a_t, r, xa);
}

void low_rank_up(float* out, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt, const float* bias) {
#if defined(__x86_64__)
  if (use_avx512()) return up_avx512(out, rows, n, xa, r, bt, bias);
#endif
  up_scalar(out, rows, n, xa, r, bt, bias);
}

void low_rank_backward(const float* dy, int64_t rows, int64_t n, const float* b, const float* xa, int64_t r,
                       float scale, float* dxa, float* db) {
#if defined(__x86_64__)
  if (use_avx512()) return backward_avx512(dy, rows, n, b, xa, r, scale, dxa, db);
#endif
  backward_scalar(dy, rows, n, b, xa, r, scale, dxa, db);
}

void lora_a_grad(const float* x, int64_t rows, int64_t k, const float* dxa, int64_t r, float* da) {
#if defined(__x86_64__)
  if (use_avx512()) return a_grad_avx512(x, rows, k, dxa, r, da);
#endif
  a_grad_scalar(x, rows, k, dxa, r, da);
}

}  // namespace pykernels::lora::cpu
