// Fused LoRA CUDA kernels (declarations and the math in lora.h): the rank-r LoRA term, rank-r
// GEMMs of mixed dtypes (fp32 LoRA weights and intermediates against 16-bit activations, split over
// k), fp32 factors as bf16 pieces for the tensor-core GEMMs (lora_rank_pieces.h) and dtype casts.
// The GEMMs of one input dtype are csrc/common/'s (gemm_sm80.cu, the sm_90a core).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "lora/lora.h"

namespace pykernels::lora {
namespace {

constexpr int kThreads = 256;

// ------------------------------------------------------------------ the LoRA term
// out[m, n] = scaling * sum_j xa[m, j] * b[n, j] + bias[n]: a rank-r product, r small (<= 512 in
// practice, any r works). Each CTA owns a 64 x 64 tile of out, staged through shared memory in
// slices of 16 along r; each thread accumulates a 4 x 4 sub-tile in fp32 (rows ty + 16 i, columns
// tx + 16 j, so a warp's stores to a row are contiguous).
constexpr int kTermTile = 64;   // rows and columns of out per CTA
constexpr int kTermSlice = 16;  // r per shared-memory stage
constexpr int kTermPerThread = kTermTile / 16;

template <typename TB, typename TOut>
__global__ void __launch_bounds__(kThreads) low_rank_term_kernel(const float* __restrict__ xa,  // [m, r]
                                                                 const TB* __restrict__ b,      // [n, r]
                                                                 const TOut* __restrict__ bias, // [n] or null
                                                                 float scaling, int64_t m, int64_t n, int64_t r,
                                                                 TOut* __restrict__ out) {      // [m, n]
  __shared__ float xa_tile[kTermSlice][kTermTile + 1];  // [j][row], +1 breaks bank conflicts on the stores
  __shared__ float b_tile[kTermSlice][kTermTile + 1];   // [j][col]
  const int64_t row0 = int64_t(blockIdx.x) * kTermTile;
  const int64_t col0 = int64_t(blockIdx.y) * kTermTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[kTermPerThread][kTermPerThread] = {};
  for (int64_t j0 = 0; j0 < r; j0 += kTermSlice) {
    for (int e = threadIdx.x; e < kTermTile * kTermSlice; e += kThreads) {
      const int local = e / kTermSlice, jj = e % kTermSlice;  // 16 consecutive threads read 16 consecutive j
      const int64_t j = j0 + jj;
      const bool j_ok = j < r;
      xa_tile[jj][local] = (j_ok && row0 + local < m) ? xa[(row0 + local) * r + j] : 0.0f;
      b_tile[jj][local] = (j_ok && col0 + local < n) ? to_float(b[(col0 + local) * r + j]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int jj = 0; jj < kTermSlice; ++jj) {
      float a_values[kTermPerThread], b_values[kTermPerThread];
#pragma unroll
      for (int i = 0; i < kTermPerThread; ++i) {
        a_values[i] = xa_tile[jj][ty + 16 * i];
        b_values[i] = b_tile[jj][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < kTermPerThread; ++i)
#pragma unroll
        for (int k = 0; k < kTermPerThread; ++k) acc[i][k] += a_values[i] * b_values[k];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kTermPerThread; ++i) {
    const int64_t row = row0 + ty + 16 * i;
    if (row >= m) continue;
#pragma unroll
    for (int k = 0; k < kTermPerThread; ++k) {
      const int64_t col = col0 + tx + 16 * k;
      if (col >= n) continue;
      const float shift = bias != nullptr ? to_float(bias[col]) : 0.0f;
      out[row * n + col] = from_float<TOut>(scaling * acc[i][k] + shift);
    }
  }
}

// ------------------------------------------------------------------ rank-r GEMM, mixed dtypes
// D = alpha op_a op_b (+ D) with per-operand dtypes read as fp32 (see RankGemmParams). Each CTA
// owns a kTileM x kTileN tile of D (rank_tile) and one range of k (blockIdx.z of the split-k plan,
// rank_gemm_split), staged through shared memory in slices of 16 along k; thread (tx, ty) of a
// 16 x 16 grid (rank_thread) accumulates the rows rank_fragment_index(kTileM, ty, i) and the columns
// rank_fragment_index(kTileN, tx, j) in fp32 (lora.h: 16-byte shared loads). Unsplit, the CTA writes
// D; split, its plane of the workspace, and rank_gemm_reduce_kernel writes D. Dtypes are runtime
// values: the switch is uniform per CTA and costs a few instructions per load on a kernel bound by
// its loads, against 27x the instantiations.
template <int kTileM, int kTileN>
struct RankTileShape {
  static constexpr int kSlice = 16;                // k per shared-memory stage
  static constexpr int kRowsPerThread = kTileM / 16;
  static constexpr int kColsPerThread = kTileN / 16;
};

__device__ __forceinline__ float load_as_float(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[index]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  }
}

__device__ __forceinline__ void store_from_float(void* base, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[index] = value; break;
    case DType::kFloat16: static_cast<__half*>(base)[index] = __float2half_rn(value); break;
    default: static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value); break;
  }
}

// Fills tile[kk][local] (local < extent rows of the operand, kk < kSlice) from an operand whose
// element (row, kk) sits at row * stride_row + kk * stride_k: consecutive threads walk whichever
// index is contiguous in memory, so the global loads coalesce for both layouts.
template <int kExtent, int kSlice>
__device__ __forceinline__ void load_rank_tile(float (*tile)[rank_smem_stride(kExtent)], const void* data,
                                               DType dtype, int64_t row0, int64_t rows, int64_t stride_row,
                                               int64_t k0, int64_t k, int64_t stride_k) {
  const bool k_contiguous = stride_k == 1;
  for (int e = threadIdx.x; e < kExtent * kSlice; e += kThreads) {
    const int local = k_contiguous ? e / kSlice : e % kExtent;
    const int kk = k_contiguous ? e % kSlice : e / kExtent;
    const int64_t row = row0 + local, kg = k0 + kk;
    tile[kk][local] = (row < rows && kg < k) ? load_as_float(data, dtype, row * stride_row + kg * stride_k) : 0.0f;
  }
}

// This thread's kExtent / 16 values of one k-row of a slice (rank_fragment_index): one 16-byte load
// per group of 4.
template <int kExtent>
__device__ __forceinline__ void load_fragment(const float* k_row, int t, float (&values)[kExtent / 16]) {
  constexpr int kCount = kExtent / 16;
  if constexpr (kCount == 1) {
    values[0] = k_row[t];
  } else {
    static_assert(kCount % 4 == 0, "a thread's elements come in groups of 4");
#pragma unroll
    for (int g = 0; g < kCount / 4; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(k_row + rank_fragment_index(kExtent, t, 4 * g));
      values[4 * g] = v.x, values[4 * g + 1] = v.y, values[4 * g + 2] = v.z, values[4 * g + 3] = v.w;
    }
  }
}

template <int kTileM, int kTileN>
__global__ void __launch_bounds__(kThreads) rank_gemm_kernel(RankGemmParams p, int64_t k_per_split) {
  using Tile = RankTileShape<kTileM, kTileN>;
  __shared__ __align__(16) float a_tile[Tile::kSlice][rank_smem_stride(kTileM)];  // [kk][row of D]
  __shared__ __align__(16) float b_tile[Tile::kSlice][rank_smem_stride(kTileN)];  // [kk][column of D]
  const int64_t row0 = int64_t(blockIdx.x) * kTileM;
  const int64_t col0 = int64_t(blockIdx.y) * kTileN;
  const int64_t k_begin = int64_t(blockIdx.z) * k_per_split;
  const int64_t k_end = min_i64(p.k, k_begin + k_per_split);
  const RankThread me = rank_thread(kTileM, static_cast<int>(threadIdx.x));
  const int tx = me.tx, ty = me.ty;
  float acc[Tile::kRowsPerThread][Tile::kColsPerThread] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += Tile::kSlice) {
    load_rank_tile<kTileM, Tile::kSlice>(a_tile, p.a, p.a_dtype, row0, p.m, p.a_stride_m, k0, k_end, p.a_stride_k);
    load_rank_tile<kTileN, Tile::kSlice>(b_tile, p.b, p.b_dtype, col0, p.n, p.b_stride_n, k0, k_end, p.b_stride_k);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < Tile::kSlice; ++kk) {
      float a_values[Tile::kRowsPerThread], b_values[Tile::kColsPerThread];
      load_fragment<kTileM>(a_tile[kk], ty, a_values);
      load_fragment<kTileN>(b_tile[kk], tx, b_values);
#pragma unroll
      for (int i = 0; i < Tile::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tile::kColsPerThread; ++j) acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {
    const int64_t row = row0 + rank_fragment_index(kTileM, ty, i);
    if (row >= p.m) continue;
#pragma unroll
    for (int j = 0; j < Tile::kColsPerThread; ++j) {
      const int64_t col = col0 + rank_fragment_index(kTileN, tx, j);
      if (col >= p.n) continue;
      if (gridDim.z > 1) {  // this split's plane: [splits, m, n]
        p.workspace[(int64_t(blockIdx.z) * p.m + row) * p.n + col] = acc[i][j];
        continue;
      }
      const int64_t index = row * p.ldd + col;
      const float prior = p.accumulate ? load_as_float(p.d, p.d_dtype, index) : 0.0f;
      store_from_float(p.d, p.d_dtype, index, p.alpha * acc[i][j] + prior);  // one rounding
    }
  }
}

// D = alpha (sum of the split planes, in split order) (+ D): one rounding, as unsplit.
__global__ void __launch_bounds__(kThreads) rank_gemm_reduce_kernel(RankGemmParams p, int64_t splits) {
  const int64_t plane = p.m * p.n;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < plane; e += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int64_t z = 0; z < splits; ++z) sum += p.workspace[z * plane + e];
    const int64_t index = (e / p.n) * p.ldd + e % p.n;
    const float prior = p.accumulate ? load_as_float(p.d, p.d_dtype, index) : 0.0f;
    store_from_float(p.d, p.d_dtype, index, p.alpha * sum + prior);
  }
}

template <int kTileM, int kTileN>
const char* launch_rank_tiles(const RankGemmParams& p, cudaStream_t stream) {
  const int64_t row_tiles = (p.m + kTileM - 1) / kTileM;
  const int64_t col_tiles = (p.n + kTileN - 1) / kTileN;
  if (row_tiles > INT32_MAX || col_tiles > 65535) return "lora rank gemm: output too large for one launch";
  const RankSplit split = rank_gemm_split(p.m, p.n, p.k, p.sms);
  if (split.splits > 1 && p.workspace == nullptr)
    return "lora rank gemm: a split-k plan needs rank_gemm_workspace_floats(p) floats of workspace";
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles),
                  static_cast<unsigned>(split.splits));
  rank_gemm_kernel<kTileM, kTileN><<<grid, kThreads, 0, stream>>>(p, split.k_per_split);
  if (split.splits == 1) return launch_status("lora rank gemm: kernel launch failed");
  if (const char* error = launch_status("lora rank gemm: kernel launch failed")) return error;
  rank_gemm_reduce_kernel<<<grid_for(p.m * p.n, kThreads), kThreads, 0, stream>>>(p, split.splits);
  return launch_status("lora rank gemm: reduce kernel launch failed");
}

// ------------------------------------------------------------------ U and V of the extended K
// One element of U (rows [0, m)) or V (rows [m, m + n)) per thread step: ~1.5 MB written at
// T 8192, r 16 against a GEMM that reads ~180 MB, so a plain grid-stride loop is enough.
template <typename TB>
__global__ void __launch_bounds__(kThreads) extended_k_operands_kernel(const ExtendedKOperandsParams p) {
  const int64_t width = p.layout.width, total = (p.m + p.n) * width;
  const TB* b = static_cast<const TB*>(p.b);
  const __nv_bfloat16* bias = static_cast<const __nv_bfloat16*>(p.bias);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / width, col = i % width;
    const int64_t r = p.layout.r;
    if (row < p.m) {
      const float u = extended_u(p.layout, p.xa + row * r, p.scaling, col);
      static_cast<__nv_bfloat16*>(p.u)[i] = __float2bfloat16_rn(u);  // exact: u is a bf16 value
    } else {
      const int64_t o = row - p.m;
      const float b_value = col < p.layout.terms * r ? to_float(b[o * r + col % r]) : 0.0f;
      const float bias_value = p.layout.bias ? __bfloat162float(bias[o]) : 0.0f;
      const float v = extended_v(p.layout, b_value, bias_value, col);
      static_cast<__nv_bfloat16*>(p.v)[o * width + col] = __float2bfloat16_rn(v);
    }
  }
}

// ------------------------------------------------------------------ fp32 factors as bf16 pieces
// One thread per element of the blocked matrix (lora_rank_pieces.h): small operands (r columns or
// rows), a pass over each.
template <typename TSrc>
__global__ void __launch_bounds__(kThreads) split_pieces_kernel(const TSrc* __restrict__ src, const PieceLayout l,
                                                                __nv_bfloat16* __restrict__ out) {
  const int64_t per_block = l.rows * l.cols, total = per_block * l.blocks;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int b = static_cast<int>(e / per_block);
    const int64_t i = e % per_block / l.cols, j = e % l.cols;
    out[piece_offset(l, b, i, j)] = __float2bfloat16_rn(bf16_piece(to_float(src[i * l.cols + j]), l.piece[b]));
  }
}

template <typename TOut>
__global__ void __launch_bounds__(kThreads) sum_pieces_kernel(const float* __restrict__ product, const PieceLayout l,
                                                              TOut* __restrict__ out) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < l.rows * l.cols;
       e += int64_t(gridDim.x) * blockDim.x)
    out[e] = from_float<TOut>(sum_pieces_at(l, product, e / l.cols, e % l.cols));
}

// ------------------------------------------------------------------ casts
template <typename TSrc, typename TDst>
__global__ void __launch_bounds__(kThreads) cast_kernel(const TSrc* __restrict__ src, TDst* __restrict__ dst,
                                                        int64_t numel) {  // [numel] each
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_float<TDst>(to_float(src[i]));  // every 16-bit value is exact in fp32: one rounding
}

}  // namespace

const char* launch_low_rank_term(const LowRankParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.r < 1) return "lora low-rank term: m, n must be >= 0 and r >= 1";
  if (p.m == 0 || p.n == 0) return nullptr;
  const int64_t row_tiles = (p.m + kTermTile - 1) / kTermTile;
  const int64_t col_tiles = (p.n + kTermTile - 1) / kTermTile;
  if (row_tiles > INT32_MAX || col_tiles > 65535) return "lora low-rank term: out is too large for one launch";
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  return with_element(p.out_dtype, [&](auto out_element) {
    using TOut = decltype(out_element);
    return with_element(p.b_dtype, [&](auto b_element) {
      using TB = decltype(b_element);
      low_rank_term_kernel<TB, TOut><<<grid, kThreads, 0, stream>>>(
          p.xa, static_cast<const TB*>(p.b), static_cast<const TOut*>(p.bias), p.scaling, p.m, p.n, p.r,
          static_cast<TOut*>(p.out));
      return launch_status("lora low-rank term: kernel launch failed");
    });
  });
}

const char* launch_extended_k_operands(const ExtendedKOperandsParams& p, cudaStream_t stream) {
  const ExtendedK& e = p.layout;
  if (p.m < 0 || p.n < 0 || e.r < 1 || e.width < e.terms * e.r + (e.bias ? 1 : 0))
    return "lora extended-K operands: need m, n >= 0, r >= 1 and room for every term";
  if (p.b_dtype == DType::kFloat16 || (p.b_dtype == DType::kFloat32) != (e.terms == 3) || (e.bias && p.bias == nullptr))
    return "lora extended-K operands: B must be fp32 (three terms) or bf16 (two), and a bias given when laid out";
  if (p.m + p.n == 0) return nullptr;
  return with_element(p.b_dtype, [&](auto b_element) {
    using TB = decltype(b_element);
    extended_k_operands_kernel<TB><<<grid_for((p.m + p.n) * e.width, kThreads), kThreads, 0, stream>>>(p);
    return launch_status("lora extended-K operands: kernel launch failed");
  });
}

const char* launch_rank_gemm(const RankGemmParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.k < 0) return "lora rank gemm: m, n, k must be >= 0";
  if (p.m == 0 || p.n == 0) return nullptr;
  if (p.d == nullptr || p.ldd < p.n) return "lora rank gemm: d must be non-null with ldd >= n";
  if (p.k > 0 && (p.a == nullptr || p.b == nullptr)) return "lora rank gemm: a and b must be non-null";
  const RankTile tile = rank_tile(p.m, p.n);
  if (tile.n == 16) return launch_rank_tiles<128, 16>(p, stream);
  if (tile.m == 16) return launch_rank_tiles<16, 128>(p, stream);
  return launch_rank_tiles<64, 64>(p, stream);
}

const char* launch_split_pieces(const void* src, DType src_dtype, const PieceLayout& l, void* out,
                                cudaStream_t stream) {
  if (l.rows < 0 || l.cols < 0 || l.blocks < 1 || l.blocks > kMaxPieceBlocks)
    return "lora pieces: rows, cols >= 0 and 1 to 6 blocks";
  if (l.rows * l.cols == 0) return nullptr;
  return with_element(src_dtype, [&](auto src_element) {
    using TSrc = decltype(src_element);
    split_pieces_kernel<TSrc><<<grid_for(l.rows * l.cols * l.blocks, kThreads), kThreads, 0, stream>>>(
        static_cast<const TSrc*>(src), l, static_cast<__nv_bfloat16*>(out));
    return launch_status("lora pieces: kernel launch failed");
  });
}

const char* launch_sum_pieces(const float* product, const PieceLayout& l, void* out, DType out_dtype,
                              cudaStream_t stream) {
  if (l.rows < 0 || l.cols < 0 || l.blocks != 3) return "lora pieces sum: rows, cols >= 0 and three blocks";
  if (l.rows * l.cols == 0) return nullptr;
  return with_element(out_dtype, [&](auto out_element) {
    using TOut = decltype(out_element);
    sum_pieces_kernel<TOut><<<grid_for(l.rows * l.cols, kThreads), kThreads, 0, stream>>>(product, l,
                                                                                         static_cast<TOut*>(out));
    return launch_status("lora pieces sum: kernel launch failed");
  });
}

int device_multiprocessors(int device) {
  int sms = 0;
  return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? sms : 0;
}

const char* launch_cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t numel,
                        cudaStream_t stream) {
  if (numel < 0) return "lora cast: numel must be >= 0";
  if (numel == 0) return nullptr;
  return with_element(src_dtype, [&](auto src_element) {
    using TSrc = decltype(src_element);
    return with_element(dst_dtype, [&](auto dst_element) {
      using TDst = decltype(dst_element);
      cast_kernel<TSrc, TDst><<<grid_for(numel, kThreads), kThreads, 0, stream>>>(static_cast<const TSrc*>(src),
                                                                         static_cast<TDst*>(dst), numel);
      return launch_status("lora cast: kernel launch failed");
    });
  });
}

}  // namespace pykernels::lora
