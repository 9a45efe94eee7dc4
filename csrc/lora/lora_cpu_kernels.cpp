// LoRA rank-r CPU kernels (see lora_cpu_kernels.h): fp32 in, fp32 out, broadcast-FMA inner loops.
#include "lora/lora_cpu_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/cpu_isa.h"

#if defined(__x86_64__)
#include "common/cpu_simd.h"
#endif

namespace pykernels::lora::cpu {
namespace {

constexpr int kLanes = 16;       // fp32 lanes of a 512-bit vector
constexpr int kMaxVectors = 4;   // r handled in chunks of 64 lanes: 4 accumulators per row
constexpr int kDownRows = 4;     // rows sharing each load of A^T in low_rank_down
constexpr int kUpRows = 4;       // rows sharing each load of B^T in low_rank_up
constexpr int kAGradJ = 8;       // rows of dA per register tile in lora_a_grad (8 x 32 fp32)
// Tiles of A^T (low_rank_down) and of B and dB together (low_rank_backward) sized to stay in the
// 32-48 KiB L1 across the rows of a block: 256 k / rows of N per tile at r <= 16, 64 at r = 64.
constexpr int64_t kTileVectorRows = 256;  // tile rows x 512-bit vectors per row

// ---------------------------------------------------------------- portable versions
void down_scalar(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < r; ++j) {
      float sum = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) sum += x[i * k + kk] * a_t[kk * r + j];
      xa[i * r + j] = sum;
    }
}

void store_scalar(float value, void* out, int64_t index, DType dtype) {
  if (dtype == DType::kFloat32) {
    static_cast<float*>(out)[index] = value;
  } else if (dtype == DType::kBFloat16) {
    static_cast<c10::BFloat16*>(out)[index] = c10::BFloat16(value);
  } else {
    static_cast<c10::Half*>(out)[index] = c10::Half(value);
  }
}

void up_scalar(void* out, DType out_dtype, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt,
               const float* bias) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < n; ++c) {
      float sum = bias != nullptr ? bias[c] : 0.0f;
      const float* tile = bt + (c / kUpColumnTile) * r * kUpColumnTile + c % kUpColumnTile;
      for (int64_t j = 0; j < r; ++j) sum += xa[i * r + j] * tile[j * kUpColumnTile];
      store_scalar(sum, out, i * n + c, out_dtype);
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
// The kernels walk the long dimension in tiles and, within a tile, all rows of their chunk: the tile
// of A^T / B^T / B and dB they read and write (16-32 KiB) then stays in L1 across the rows instead
// of streaming from L2 or memory once per row group. lora_a_grad instead sums a whole chunk of rows
// into a register tile of dA.
PK_AVX512 inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

PK_AVX512 inline __mmask16 lane_mask(int64_t remaining) {  // tail_mask, and no lanes when <= 0
  return remaining <= 0 ? __mmask16(0) : tail_mask(remaining);
}

// xa rows [0, kRows) of lanes [c0, c0 + 16 kV), over k in [k0, k1): accumulated onto xa unless
// `first`. Register tiles have compile-time sizes (kRows, kV) and fully unrolled loops: with a
// runtime vector count GCC kept the accumulators on the stack, a load and a store per FMA.
template <int kRows, int kV>
PK_AVX512 void down_block(const float* x, int64_t k, int64_t k0, int64_t k1, const float* a_t, int64_t r,
                                 int64_t c0, bool first, float* xa) {
  __m512 acc[kRows][kV];
  __mmask16 mask[kV];
#pragma GCC unroll 4
  for (int v = 0; v < kV; ++v) {
    mask[v] = tail_mask(r - c0 - v * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i)
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], xa + i * r + c0 + v * kLanes);
  }
  for (int64_t kk = k0; kk < k1; ++kk) {
    __m512 a[kV];
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) a[v] = _mm512_maskz_loadu_ps(mask[v], a_t + kk * r + c0 + v * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * k + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < kV; ++v) acc[i][v] = _mm512_fmadd_ps(xv, a[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) _mm512_mask_storeu_ps(xa + i * r + c0 + v * kLanes, mask[v], acc[i][v]);
}

template <int kV>
PK_AVX512 void down_tile(const float* x, int64_t rows, int64_t k, int64_t k0, int64_t k1, const float* a_t,
                                int64_t r, int64_t c0, float* xa) {
  int64_t i = 0;
  for (; i + kDownRows <= rows; i += kDownRows)
    down_block<kDownRows, kV>(x + i * k, k, k0, k1, a_t, r, c0, k0 == 0, xa + i * r);
  for (; i < rows; ++i) down_block<1, kV>(x + i * k, k, k0, k1, a_t, r, c0, k0 == 0, xa + i * r);
}

PK_AVX512 void down_avx512(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
  for (int64_t c0 = 0; c0 < r; c0 += kMaxVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kMaxVectors, (r - c0 + kLanes - 1) / kLanes));
    const int64_t tile = kTileVectorRows / vectors;
    for (int64_t k0 = 0; k0 < k; k0 += tile) {
      const int64_t k1 = std::min(k, k0 + tile);
      switch (vectors) {
        case 1: down_tile<1>(x, rows, k, k0, k1, a_t, r, c0, xa); break;
        case 2: down_tile<2>(x, rows, k, k0, k1, a_t, r, c0, xa); break;
        case 3: down_tile<3>(x, rows, k, k0, k1, a_t, r, c0, xa); break;
        default: down_tile<4>(x, rows, k, k0, k1, a_t, r, c0, xa); break;
      }
    }
  }
}

// out[index .. index + 16) (lanes in `mask`) = v, rounded to kOut.
template <DType kOut>
PK_AVX512 inline void store_lanes(void* out, int64_t index, __mmask16 mask, __m512 v) {
  if constexpr (kOut == DType::kFloat32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + index, mask, v);
  } else if constexpr (kOut == DType::kBFloat16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + index, mask, round_to_bf16_x16(v));
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + index, mask,
                             _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Columns [c, c + 64) of rows [0, kRows), masked past `c1`, with bt pointing at column c of its packed
// tile (rows kUpColumnTile apart): a register tile of kRows x 4 vectors, so each j costs 4 loads of
// B^T and kRows broadcasts for 4 kRows FMAs, and the sum goes straight to `out` as kOut (an fp32
// scratch output cost three extra passes over L2: zero, read, convert).
template <int kRows, DType kOut>
PK_AVX512 void up_block(void* out, int64_t n, int64_t c, int64_t c1, const float* xa, int64_t r,
                               const float* bt, const float* bias) {
  __mmask16 mask[kMaxVectors];
  __m512 acc[kRows][kMaxVectors];
#pragma GCC unroll 4
  for (int v = 0; v < kMaxVectors; ++v) {
    mask[v] = lane_mask(c1 - c - v * kLanes);
    const __m512 bias_v = bias != nullptr ? _mm512_maskz_loadu_ps(mask[v], bias + c + v * kLanes) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) acc[i][v] = bias_v;
  }
  for (int64_t j = 0; j < r; ++j) {
    __m512 b[kMaxVectors];
#pragma GCC unroll 4
    for (int v = 0; v < kMaxVectors; ++v) b[v] = _mm512_maskz_loadu_ps(mask[v], bt + j * kUpColumnTile + v * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) {
      const __m512 xv = _mm512_set1_ps(xa[i * r + j]);
#pragma GCC unroll 4
      for (int v = 0; v < kMaxVectors; ++v) acc[i][v] = _mm512_fmadd_ps(xv, b[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kMaxVectors; ++v) store_lanes<kOut>(out, i * n + c + v * kLanes, mask[v], acc[i][v]);
}

template <DType kOut>
PK_AVX512 void up_rows(void* out, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt,
                              const float* bias) {
  using Element = std::conditional_t<kOut == DType::kFloat32, float, uint16_t>;
  auto* out_rows = static_cast<Element*>(out);
  for (int64_t c0 = 0; c0 < n; c0 += kUpColumnTile) {
    const int64_t c1 = std::min(n, c0 + kUpColumnTile);
    const float* tile = bt + c0 * r;  // this tile's [r, kUpColumnTile] block, contiguous
    int64_t i = 0;
    for (; i + kUpRows <= rows; i += kUpRows)
      for (int64_t c = c0; c < c1; c += kMaxVectors * kLanes)
        up_block<kUpRows, kOut>(out_rows + i * n, n, c, c1, xa + i * r, r, tile + (c - c0), bias);
    for (; i < rows; ++i)
      for (int64_t c = c0; c < c1; c += kMaxVectors * kLanes)
        up_block<1, kOut>(out_rows + i * n, n, c, c1, xa + i * r, r, tile + (c - c0), bias);
  }
}

PK_AVX512 void up_avx512(void* out, DType out_dtype, int64_t rows, int64_t n, const float* xa, int64_t r,
                                const float* bt, const float* bias) {
  switch (out_dtype) {
    case DType::kFloat32: return up_rows<DType::kFloat32>(out, rows, n, xa, r, bt, bias);
    case DType::kBFloat16: return up_rows<DType::kBFloat16>(out, rows, n, xa, r, bt, bias);
    default: return up_rows<DType::kFloat16>(out, rows, n, xa, r, bt, bias);
  }
}

// dy rows [0, kRows), columns [n0, n1), lanes [c0, c0 + 16 kV) of r; dxa accumulated unless `first`.
// Per column of dy: kRows broadcasts, then per vector one load of B, a read-modify-write of dB and
// 2 kRows FMAs.
template <int kRows, int kV>
PK_AVX512 void backward_block(const float* dy, int64_t n, int64_t n0, int64_t n1, const float* b,
                                     const float* xa, int64_t r, int64_t c0, float scale, bool first, float* dxa,
                                     float* db) {
  __m512 grad[kRows][kV], xa_v[kRows][kV];
  __mmask16 mask[kV];
#pragma GCC unroll 4
  for (int v = 0; v < kV; ++v) {
    mask[v] = tail_mask(r - c0 - v * kLanes);
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) {
      grad[i][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[v], dxa + i * r + c0 + v * kLanes);
      xa_v[i][v] = _mm512_maskz_loadu_ps(mask[v], xa + i * r + c0 + v * kLanes);
    }
  }
  for (int64_t c = n0; c < n1; ++c) {
    __m512 g[kRows];
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i) g[i] = _mm512_set1_ps(scale * dy[i * n + c]);
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) {
      const __m512 bv = _mm512_maskz_loadu_ps(mask[v], b + c * r + c0 + v * kLanes);
      __m512 dbv = _mm512_maskz_loadu_ps(mask[v], db + c * r + c0 + v * kLanes);
#pragma GCC unroll 4
      for (int i = 0; i < kRows; ++i) {
        grad[i][v] = _mm512_fmadd_ps(g[i], bv, grad[i][v]);
        dbv = _mm512_fmadd_ps(g[i], xa_v[i][v], dbv);
      }
      _mm512_mask_storeu_ps(db + c * r + c0 + v * kLanes, mask[v], dbv);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < kV; ++v) _mm512_mask_storeu_ps(dxa + i * r + c0 + v * kLanes, mask[v], grad[i][v]);
}

// Rows per block: as many as the 32 vector registers hold (grad and xa tiles are kRows x kV each).
template <int kV>
constexpr int kBackwardRows = kV <= 2 ? 4 : 2;

template <int kV>
PK_AVX512 void backward_tile(const float* dy, int64_t rows, int64_t n, int64_t n0, int64_t n1, const float* b,
                                    const float* xa, int64_t r, int64_t c0, float scale, float* dxa, float* db) {
  constexpr int kRows = kBackwardRows<kV>;
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows)
    backward_block<kRows, kV>(dy + i * n, n, n0, n1, b, xa + i * r, r, c0, scale, n0 == 0, dxa + i * r, db);
  for (; i < rows; ++i)
    backward_block<1, kV>(dy + i * n, n, n0, n1, b, xa + i * r, r, c0, scale, n0 == 0, dxa + i * r, db);
}

PK_AVX512 void backward_avx512(const float* dy, int64_t rows, int64_t n, const float* b, const float* xa,
                                      int64_t r, float scale, float* dxa, float* db) {
  for (int64_t c0 = 0; c0 < r; c0 += kMaxVectors * kLanes) {
    const int vectors = static_cast<int>(std::min<int64_t>(kMaxVectors, (r - c0 + kLanes - 1) / kLanes));
    const int64_t tile = kTileVectorRows / vectors;
    for (int64_t n0 = 0; n0 < n; n0 += tile) {
      const int64_t n1 = std::min(n, n0 + tile);
      switch (vectors) {
        case 1: backward_tile<1>(dy, rows, n, n0, n1, b, xa, r, c0, scale, dxa, db); break;
        case 2: backward_tile<2>(dy, rows, n, n0, n1, b, xa, r, c0, scale, dxa, db); break;
        case 3: backward_tile<3>(dy, rows, n, n0, n1, b, xa, r, c0, scale, dxa, db); break;
        default: backward_tile<4>(dy, rows, n, n0, n1, b, xa, r, c0, scale, dxa, db); break;
      }
    }
  }
}

// dA rows [j0, j0 + kJ), columns [c, c + 32): summed over all rows of the chunk in registers, then
// added to dA once. (Updating dA in memory per few rows made this the slowest LoRA kernel: a load
// and a store of dA for every 4 FMAs.) Per row: two loads of x, kJ broadcasts of dxa, 2 kJ FMAs.
template <int kJ>
PK_AVX512 void a_grad_block(const float* x, int64_t rows, int64_t k, int64_t c, const float* dxa, int64_t r,
                                   int64_t j0, float* da) {
  const __mmask16 mask0 = lane_mask(k - c), mask1 = lane_mask(k - c - kLanes);
  __m512 acc0[kJ], acc1[kJ];
#pragma GCC unroll 8
  for (int j = 0; j < kJ; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 x0 = _mm512_maskz_loadu_ps(mask0, x + i * k + c);
    const __m512 x1 = _mm512_maskz_loadu_ps(mask1, x + i * k + c + kLanes);
#pragma GCC unroll 8
    for (int j = 0; j < kJ; ++j) {
      const __m512 d = _mm512_set1_ps(dxa[i * r + j0 + j]);
      acc0[j] = _mm512_fmadd_ps(d, x0, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(d, x1, acc1[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kJ; ++j) {
    float* row = da + (j0 + j) * k + c;
    _mm512_mask_storeu_ps(row, mask0, _mm512_add_ps(acc0[j], _mm512_maskz_loadu_ps(mask0, row)));
    _mm512_mask_storeu_ps(row + kLanes, mask1, _mm512_add_ps(acc1[j], _mm512_maskz_loadu_ps(mask1, row + kLanes)));
  }
}

// 32 columns at a time (that strip of x, rows x 128 B, stays in L1 across all blocks of r).
PK_AVX512 void a_grad_avx512(const float* x, int64_t rows, int64_t k, const float* dxa, int64_t r, float* da) {
  for (int64_t c = 0; c < k; c += 2 * kLanes) {
    int64_t j = 0;
    for (; j + kAGradJ <= r; j += kAGradJ) a_grad_block<kAGradJ>(x, rows, k, c, dxa, r, j, da);
    for (; j + 4 <= r; j += 4) a_grad_block<4>(x, rows, k, c, dxa, r, j, da);
    for (; j < r; ++j) a_grad_block<1>(x, rows, k, c, dxa, r, j, da);
  }
}
#endif  // __x86_64__

bool use_avx512() { return uses_avx512(active_cpu_isa()); }

#if defined(__x86_64__)
PK_AVX512 void bf16_to_fp32_avx512(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 mask = tail_mask(count - i);
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, src + i);
    _mm512_mask_storeu_ps(dst + i, mask, widen_bf16(bits));
  }
}

PK_AVX512 void fp16_to_fp32_avx512(const uint16_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const __mmask16 mask = tail_mask(count - i);
    _mm512_mask_storeu_ps(dst + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src + i)));
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

void low_rank_down(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa) {
  if (k == 0) {  // the empty sum: the AVX-512 path walks k tiles and would leave xa unwritten
    std::fill(xa, xa + rows * r, 0.0f);
    return;
  }
#if defined(__x86_64__)
  if (use_avx512()) return down_avx512(x, rows, k, a_t, r, xa);
#endif
  down_scalar(x, rows, k, a_t, r, xa);
}

void low_rank_up(void* out, DType out_dtype, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt,
                 const float* bias) {
#if defined(__x86_64__)
  if (use_avx512()) return up_avx512(out, out_dtype, rows, n, xa, r, bt, bias);
#endif
  up_scalar(out, out_dtype, rows, n, xa, r, bt, bias);
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
