// Grouped MoE CUDA kernels, GEMM side (declarations and the math in moe.h; the sort, routing maps
// and element-wise kernels are in moe_routing.cu, the shared helpers in moe_cuda_common.cuh).
//
// grouped   ONE launch for all experts: a one-block schedule kernel turns expert_offsets into a
// GEMMs     list of (bucket, first slot) row tiles on the device (grid sized by the upper bound
//           ceil(slots / BM) + E + 1; CTAs past the end exit), so nothing waits on the host.
//           The grid is 1-D with column tiles innermost (moe_schedule.h's grid_tile): a row
//           tile's gathered rows are read from HBM once, not once per column tile.
//           Row-grouped CTAs gather their operand rows straight from x through the per-slot row
//           map inside the cp.async global->shared copies (no permuted copy of x), run the LoRA
//           product as extra K-steps of the same accumulator, and gate / scatter / reduce the gate
//           gradient in the epilogue. Slot-reduction CTAs (weight gradients) gather both operands
//           the same way along K.
// configs   sm80 tensor cores (mma.sync m16n8k16, fp32 accumulation; CuTe TiledMMA, ldmatrix,
//           cp.async) for bf16 / fp16 when every operand allows 16-byte copies; a SIMT kernel with
//           element-wise loads otherwise (fp32: true fp32 FMA, no TF32; 16-bit with odd sizes).
//           Both are sm80 kernels; on Hopper they run the LoRA rank-r products (u, v, dA, dB: the
//           sm_90a core takes the rest) and everything under PYKERNELS_SM90=0. The tensor-op tile is
//           128 x 128, or 128 x 32 for a rank-r side under PYKERNELS_MOE_RANK_TILE=narrow (moe.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <utility>

#include "common/cuda_convert.cuh"
#include "common/tails.h"
#include "moe/moe.h"
#include "moe/moe_cuda_common.cuh"
#include "moe/moe_schedule.h"

namespace pykernels::moe {
using namespace detail;

namespace {

// ------------------------------------------------------------------ row-tile schedule
// tiles[t] = (bucket, first slot) of row tile t of a grouped GEMM with rows_per_tile slots per
// tile; (-1, 0) past the last tile. tile_start [E + 2] is scratch (each bucket's first tile). The
// arithmetic is moe_schedule.h's (tested on the host); the scan is the one-block cub scan.
__global__ void __launch_bounds__(kScanThreads) tile_schedule_kernel(const int64_t* offsets, int64_t experts,
                                                                     int64_t slots, int rows_per_tile,
                                                                     int64_t* tile_start, int2* tiles,
                                                                     int64_t max_tiles) {
  __shared__ BlockScan::TempStorage scratch;
  for (int64_t b = threadIdx.x; b <= experts; b += kScanThreads)
    tile_start[b] = bucket_row_tiles(bucket_slots(offsets, experts, slots, b), rows_per_tile);
  __syncthreads();
  const int64_t total = exclusive_scan(tile_start, experts + 1, scratch);
  for (int64_t t = threadIdx.x; t < max_tiles; t += kScanThreads) {
    if (t >= total) {
      tiles[t] = make_int2(-1, 0);
      continue;
    }
    const RowTileStart start = row_tile_start(offsets, experts, slots, tile_start, rows_per_tile, t);
    tiles[t] = make_int2(static_cast<int>(start.bucket), static_cast<int>(start.first));
  }
}

// This CTA's tile (moe_schedule.h's grid_tile: column tiles innermost): the slots [begin, end) of
// its row tile, their bucket, and its column tile; false when the CTA has no row tile.
struct RowTile {
  int64_t bucket, begin, end, column;
};
__device__ bool row_tile(const GroupedRowsParams& p, const int2* tiles, int rows_per_tile, int cols_per_tile,
                         RowTile& tile) {
  const GridTile cta = grid_tile(blockIdx.x, ceil_div(p.n_cols, cols_per_tile));
  const int2 entry = tiles[cta.row];
  if (entry.x < 0) return false;
  const SlotRange r = bucket_slots(p.expert_offsets, p.experts, p.slots, entry.x);
  tile = {entry.x, entry.y, row_tile_end(entry.y, rows_per_tile, r), cta.column};
  return true;
}

// Destination row of slot s, null when nothing is stored.
template <typename T>
__device__ T* out_row(const GroupedRowsParams& p, int64_t s) {
  if (p.out == nullptr) return nullptr;
  const int64_t row = slot_row_index(p.out_map, s, p.out_rows);
  return row >= 0 ? static_cast<T*>(p.out) + row * p.ld_out : nullptr;
}

// row[n * ld_n] = v0, row[(n + 1) * ld_n] = v1 for the columns below n_cols; one 2-element store
// when the pair is contiguous and aligned (accumulator fragments hold adjacent column pairs).
template <typename T>
__device__ void store_pair(T* row, int64_t ld_n, int64_t n, int64_t n_cols, float v0, float v1) {
  if (ld_n != 1) {
    if (n < n_cols) row[n * ld_n] = from_float<T>(v0);
    if (n + 1 < n_cols) row[(n + 1) * ld_n] = from_float<T>(v1);
    return;
  }
  if (n + 1 < n_cols && reinterpret_cast<uintptr_t>(row + n) % (2 * sizeof(T)) == 0) {
    if constexpr (std::is_same_v<T, float>) *reinterpret_cast<float2*>(row + n) = make_float2(v0, v1);
    if constexpr (std::is_same_v<T, __half>) *reinterpret_cast<__half2*>(row + n) = __floats2half2_rn(v0, v1);
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      *reinterpret_cast<__nv_bfloat162*>(row + n) = __floats2bfloat162_rn(v0, v1);
    return;
  }
  if (n < n_cols) row[n] = from_float<T>(v0);
  if (n + 1 < n_cols) row[n + 1] = from_float<T>(v1);
}

// ------------------------------------------------------------------ sm80 tensor-core kernels
namespace tensor_op {
using namespace cute;

template <typename T> struct Types;
template <> struct Types<__half> {
  using Element = half_t;
  using MmaAtom = SM80_16x8x16_F32F16F16F32_TN;
};
template <> struct Types<__nv_bfloat16> {
  using Element = bfloat16_t;
  using MmaAtom = SM80_16x8x16_F32BF16BF16F32_TN;
};

// 128 x kTileN outputs per CTA (128 x 128: 4 warps of 64 x 64; 128 x 32, the rank-r products'
// narrow tile: 4 warps of 64 x 16), K in steps of 32 through a 3-stage cp.async pipeline (CUTLASS's
// sm80 128x128_32x3 tensor-op shape). Operand tiles are K-major (rows of x, weight [E, N, K]:
// ldmatrix) or MN-major (weight [E, K, N], slot rows along K: ldmatrix.trans), with the swizzles
// CUTLASS's sm80 defaults use for conflict-free 16-byte stores and ldmatrix (64 or 32 rows wide).
template <typename T, int kTileN = 128>
struct Config {
  using Element = typename Types<T>::Element;
  static constexpr int kM = 128, kN = kTileN, kK = 32, kStages = 3, kThreads = 128;
  static_assert(kN % 32 == 0, "whole 32 x 32 tiles of the tiled MMA");
  static constexpr int kChunk = 8;       // elements per 16-byte cp.async
  static constexpr int kWarpsM = 2;      // warp w covers rows (w % 2) and columns (w / 2)
  using TiledMma = decltype(make_tiled_mma(typename Types<T>::MmaAtom{}, Layout<Shape<_2, _2, _1>>{},
                                           Tile<_32, _32, _16>{}));
  using KMajorAtom = decltype(composition(Swizzle<2, 3, 3>{}, Layout<Shape<_8, _32>, Stride<_32, _1>>{}));
  using MNMajorAtom64 = decltype(composition(Swizzle<3, 3, 3>{}, Layout<Shape<_64, _8>, Stride<_1, _64>>{}));
  using MNMajorAtom32 = decltype(composition(Swizzle<2, 3, 3>{}, Layout<Shape<_32, _8>, Stride<_1, _32>>{}));
  template <bool kKMajor, int kRows>  // (rows, k, stage)
  using Smem = decltype(tile_to_shape(
      std::conditional_t<kKMajor, KMajorAtom, std::conditional_t<kRows % 64 == 0, MNMajorAtom64, MNMajorAtom32>>{},
      Shape<Int<kRows>, Int<kK>, Int<kStages>>{}));
  template <bool kKMajor>
  using SmemCopy = Copy_Atom<std::conditional_t<kKMajor, SM75_U32x4_LDSM_N, SM75_U16x8_LDSM_T>, Element>;
};

template <class Cfg, bool kAKMajor, bool kBKMajor>
struct Pipeline {
  using LayoutA = typename Cfg::template Smem<kAKMajor, Cfg::kM>;
  using LayoutB = typename Cfg::template Smem<kBKMajor, Cfg::kN>;
  array_aligned<typename Cfg::Element, cosize_v<LayoutA>, 128> a;
  array_aligned<typename Cfg::Element, cosize_v<LayoutB>, 128> b;
};

template <typename E>
__device__ void copy_16_bytes(const E* src, E* dst, bool valid) {  // zero-fills dst when !valid
  SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(src),
                                                   *reinterpret_cast<uint128_t*>(dst), valid);
}

__device__ unsigned char* dynamic_smem() {
  extern __shared__ __align__(128) unsigned char smem[];
  return smem;
}

// acc += A B^T over k_tiles tiles. load(tile, stage) issues the tile's cp.async copies into
// (sA, sB)(_, _, stage); tile i's MMAs overlap the copies of tiles i + 1 .. i + kStages - 1.
template <class Cfg, bool kAKMajor, bool kBKMajor, class SA, class SB, class Acc, class Load>
__device__ void mainloop(int k_tiles, SA& sA, SB& sB, Acc& acc, Load&& load) {
  typename Cfg::TiledMma mma;
  auto thr_mma = mma.get_slice(threadIdx.x);
  Tensor tCrA = thr_mma.partition_fragment_A(sA(_, _, 0));
  Tensor tCrB = thr_mma.partition_fragment_B(sB(_, _, 0));
  auto s2r_a = make_tiled_copy_A(typename Cfg::template SmemCopy<kAKMajor>{}, mma);
  auto s2r_b = make_tiled_copy_B(typename Cfg::template SmemCopy<kBKMajor>{}, mma);
  auto thr_s2r_a = s2r_a.get_slice(threadIdx.x);
  auto thr_s2r_b = s2r_b.get_slice(threadIdx.x);
  Tensor tXsA = thr_s2r_a.partition_S(sA);
  Tensor tXrA = thr_s2r_a.retile_D(tCrA);
  Tensor tXsB = thr_s2r_b.partition_S(sB);
  Tensor tXrB = thr_s2r_b.retile_D(tCrB);
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    cp_async_fence();  // one group per tile, empty ones included: the wait count stays exact
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Cfg::kStages - 2>();  // tile kt has landed
    __syncthreads();                    // ... for every thread, and tile kt - 1's stage is free
    const int next = kt + Cfg::kStages - 1;
    if (next < k_tiles) load(next, next % Cfg::kStages);
    cp_async_fence();
    const int stage = kt % Cfg::kStages;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      copy(s2r_a, tXsA(_, _, kb, stage), tXrA(_, _, kb));
      copy(s2r_b, tXsB(_, _, kb, stage), tXrB(_, _, kb));
      gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), acc);
    }
  }
  cp_async_wait<0>();
}

template <class Cfg, bool kBKMajor>
struct RowsSmem {
  Pipeline<Cfg, true, kBKMajor> pipe;
  const typename Cfg::Element* rows[2][Cfg::kM];  // each slot's row of a and a2 (null: zeros)
  float row_dot[2][Cfg::kM];                      // gate-gradient partials of the two warp columns
};

// Epilogue of a row tile. The m16n8 accumulator layout gives each thread, per (mi, h, ni), two
// adjacent columns (c = 0, 1) of one row; the 4 lanes of a quad share the row, and so do the two
// warps of a warp row: the gate-gradient dot is reduced over the quad by shuffles, then over the
// two warps through shared memory, in a fixed order.
template <typename T, class Cfg, class Acc>
__device__ void rows_epilogue(const GroupedRowsParams& p, const RowTile& tile, int64_t n0, Acc& acc,
                              float (&row_dot)[2][Cfg::kM]) {
  typename Cfg::TiledMma mma;
  const auto shape = Shape<Int<Cfg::kM>, Int<Cfg::kN>>{};
  Tensor coord = mma.get_slice(threadIdx.x).partition_C(make_identity_tensor(shape));  // (m, n) of each acc
  static_assert(decltype(size<0>(acc))::value == 4, "the m16n8 accumulator holds (2 columns) x (2 row halves)");
  const int64_t dot_cols = p.n_cols < p.dot_rows.cols ? p.n_cols : p.dot_rows.cols;
  const int warp_n = threadIdx.x / (32 * Cfg::kWarpsM);
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc); ++mi) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int m = get<0>(coord(make_coord(0, h), mi, 0));
      const int64_t s = tile.begin + m;
      const bool in_tile = s < tile.end;
      const float gate = in_tile && p.gate_of_slot != nullptr ? p.gate_of_slot[s] : 1.0f;
      T* out = in_tile ? out_row<T>(p, s) : nullptr;
      const T* dot_row = in_tile && p.dgate_partial != nullptr ? slot_row<T>(p.dot_rows, s) : nullptr;
      float dot = 0.0f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        const int64_t n = n0 + get<1>(coord(make_coord(0, h), mi, ni));
        const float v0 = p.alpha * acc(make_coord(0, h), mi, ni), v1 = p.alpha * acc(make_coord(1, h), mi, ni);
        if (dot_row != nullptr && n < dot_cols) dot += v0 * to_float(dot_row[n]);
        if (dot_row != nullptr && n + 1 < dot_cols) dot += v1 * to_float(dot_row[n + 1]);
        if (out != nullptr) store_pair(out, 1, n, p.n_cols, v0 * gate, v1 * gate);
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      if (threadIdx.x % 4 == 0) row_dot[warp_n][m] = dot;
    }
  }
  if (p.dgate_partial == nullptr) return;
  __syncthreads();
  for (int i = threadIdx.x; i < Cfg::kM; i += Cfg::kThreads) {
    if (tile.begin + i < tile.end)
      p.dgate_partial[tile.column * p.slots + tile.begin + i] = row_dot[0][i] + row_dot[1][i];
  }
}

// One row tile x one column tile (row_tile) of kTileN columns.
template <typename T, bool kBKMajor, int kTileN>
__global__ void __launch_bounds__(Config<T>::kThreads) rows_kernel(const GroupedRowsParams p, const int2* tiles) {
  using Cfg = Config<T, kTileN>;
  using E = typename Cfg::Element;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kK = Cfg::kK, kC = Cfg::kChunk;
  RowTile tile;
  if (!row_tile(p, tiles, kM, kN, tile)) return;
  auto& smem = *reinterpret_cast<RowsSmem<Cfg, kBKMajor>*>(dynamic_smem());
  using Pipe = Pipeline<Cfg, true, kBKMajor>;
  Tensor sA = make_tensor(make_smem_ptr(smem.pipe.a.data()), typename Pipe::LayoutA{});  // (m, k, stage)
  Tensor sB = make_tensor(make_smem_ptr(smem.pipe.b.data()), typename Pipe::LayoutB{});  // (n, k, stage)
  for (int i = threadIdx.x; i < kM; i += Cfg::kThreads) {
    const int64_t s = tile.begin + i;
    smem.rows[0][i] = s < tile.end ? slot_row<E>(p.a, s) : nullptr;
    smem.rows[1][i] = s < tile.end && p.a2.cols > 0 ? slot_row<E>(p.a2, s) : nullptr;
  }
  __syncthreads();
  const bool dropped = tile.bucket == p.experts;  // zero rows: no product
  const int k1_tiles = dropped ? 0 : static_cast<int>(ceil_div(p.a.cols, kK));
  const int k2_tiles = dropped ? 0 : static_cast<int>(ceil_div(p.a2.cols, kK));
  const int64_t n0 = tile.column * kN;
  auto load = [&](int kt, int stage) {
    const int lora = kt >= k1_tiles;  // the LoRA product's K-steps follow the base product's
    const int64_t k0 = int64_t(lora ? kt - k1_tiles : kt) * kK;
    const int64_t a_cols = lora ? p.a2.cols : p.a.cols;
    const E* a_base = static_cast<const E*>(lora ? p.a2.data : p.a.data);
    for (int c = threadIdx.x; c < kM * kK / kC; c += Cfg::kThreads) {
      const int row = c / (kK / kC), k = c % (kK / kC) * kC;
      const E* src = smem.rows[lora][row];
      const bool valid = src != nullptr && k0 + k < a_cols;
      copy_16_bytes(valid ? src + k0 + k : a_base, &sA(row, k, stage), valid);
    }
    const ExpertMatrix b = lora ? p.b2 : p.b;
    const E* b_expert = static_cast<const E*>(b.data) + tile.bucket * b.expert_stride;
    for (int c = threadIdx.x; c < kN * kK / kC; c += Cfg::kThreads) {
      const int n = kBKMajor ? c / (kK / kC) : c % (kN / kC) * kC;
      const int k = kBKMajor ? c % (kK / kC) * kC : c / (kN / kC);
      const bool valid = n0 + n < p.n_cols && k0 + k < b.k_limit;
      const E* src = valid ? b_expert + (n0 + n) * b.ld_n + (k0 + k) * b.ld_k : b_expert;
      copy_16_bytes(src, &sB(n, k, stage), valid);
    }
  };
  Tensor acc = partition_fragment_C(typename Cfg::TiledMma{}, Shape<Int<kM>, Int<kN>>{});
  clear(acc);
  mainloop<Cfg, true, kBKMajor>(k1_tiles + k2_tiles, sA, sB, acc, load);
  rows_epilogue<T, Cfg>(p, tile, n0, acc, smem.row_dot);
}

// One (m, n) output tile of expert blockIdx.z; K runs over the expert's slots.
template <typename T, int kTileN>
__global__ void __launch_bounds__(Config<T>::kThreads) weight_grad_kernel(const GroupedWeightGradParams p) {
  using Cfg = Config<T, kTileN>;
  using E = typename Cfg::Element;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kK = Cfg::kK, kC = Cfg::kChunk;
  using Pipe = Pipeline<Cfg, false, false>;
  auto& smem = *reinterpret_cast<Pipe*>(dynamic_smem());
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Pipe::LayoutA{});  // (m, k, stage)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Pipe::LayoutB{});  // (n, k, stage)
  const int64_t expert = blockIdx.z, m0 = int64_t(blockIdx.x) * kM, n0 = int64_t(blockIdx.y) * kN;
  const SlotRange slots = bucket_slots(p.expert_offsets, p.experts, p.slots, expert);
  // Both operands are slot rows along K: a chunk is 8 consecutive m (or n) of one slot's row; width
  // (Int<kM> or Int<kN>) is the tile's extent along them.
  auto load_rows = [&](const SlotRows& op, int64_t c0, int64_t s0, auto& smem_tile, int stage, auto width) {
    constexpr int kW = decltype(width)::value;
    for (int c = threadIdx.x; c < kW * kK / kC; c += Cfg::kThreads) {
      const int k = c / (kW / kC), col = c % (kW / kC) * kC;
      const E* src = s0 + k < slots.end ? slot_row<E>(op, s0 + k) : nullptr;
      const bool valid = src != nullptr && c0 + col < op.cols;
      copy_16_bytes(valid ? src + c0 + col : static_cast<const E*>(op.data), &smem_tile(col, k, stage), valid);
    }
  };
  auto load = [&](int kt, int stage) {
    const int64_t s0 = slots.begin + int64_t(kt) * kK;
    load_rows(p.a, m0, s0, sA, stage, Int<kM>{});
    load_rows(p.b, n0, s0, sB, stage, Int<kN>{});
  };
  Tensor acc = partition_fragment_C(typename Cfg::TiledMma{}, Shape<Int<kM>, Int<kN>>{});
  clear(acc);
  mainloop<Cfg, false, false>(static_cast<int>(ceil_div(slots.end - slots.begin, kK)), sA, sB, acc, load);
  typename Cfg::TiledMma mma;
  Tensor coord = mma.get_slice(threadIdx.x).partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
  T* out = static_cast<T*>(p.out) + expert * p.expert_stride;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc); ++mi) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {  // (see rows_epilogue for the accumulator layout)
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        const auto first = coord(make_coord(0, h), mi, ni);
        const int64_t m = m0 + get<0>(first), n = n0 + get<1>(first);
        if (m < p.m_rows)
          store_pair(out + m * p.ld_m, p.ld_n, n, p.n_cols, p.alpha * acc(make_coord(0, h), mi, ni),
                     p.alpha * acc(make_coord(1, h), mi, ni));
      }
    }
  }
}

}  // namespace tensor_op

// ------------------------------------------------------------------ SIMT kernels
// 64 x 64 outputs per CTA, 256 threads of 4 x 4 (rows ty + 16 i, columns tx + 16 j: a warp's
// stores to a row are contiguous), K in steps of 16 through shared memory, element-wise loads.
namespace simt {
constexpr int kM = 64, kN = 64, kK = 16, kThreads = 256, kPerThread = 4;

struct Tiles {
  float a[kK][kM + 4];  // [k][m]; the padding spreads the transposing stores over the banks
  float b[kK][kN + 4];  // [k][n]
};

__device__ void multiply(const Tiles& t, float (&acc)[kPerThread][kPerThread]) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int k = 0; k < kK; ++k) {
    float a[kPerThread], b[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      a[i] = t.a[k][ty + 16 * i];
      b[i] = t.b[k][tx + 16 * i];
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) acc[i][j] += a[i] * b[j];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rows_kernel(const GroupedRowsParams p, const int2* tiles) {
  RowTile tile;
  if (!row_tile(p, tiles, kM, kN, tile)) return;
  __shared__ const T* rows[2][kM];
  __shared__ Tiles t;
  for (int i = threadIdx.x; i < kM; i += kThreads) {
    const int64_t s = tile.begin + i;
    rows[0][i] = s < tile.end ? slot_row<T>(p.a, s) : nullptr;
    rows[1][i] = s < tile.end && p.a2.cols > 0 ? slot_row<T>(p.a2, s) : nullptr;
  }
  const bool dropped = tile.bucket == p.experts;
  const int64_t k1_tiles = dropped ? 0 : ceil_div(p.a.cols, kK), k2_tiles = dropped ? 0 : ceil_div(p.a2.cols, kK);
  const int64_t n0 = tile.column * kN;
  float acc[kPerThread][kPerThread] = {};
  for (int64_t kt = 0; kt < k1_tiles + k2_tiles; ++kt) {
    const int lora = kt >= k1_tiles;
    const int64_t k0 = (lora ? kt - k1_tiles : kt) * kK, a_cols = lora ? p.a2.cols : p.a.cols;
    const ExpertMatrix b = lora ? p.b2 : p.b;
    const T* b_expert = static_cast<const T*>(b.data) + tile.bucket * b.expert_stride;
    __syncthreads();  // rows written / the previous tile consumed
    for (int e = threadIdx.x; e < kM * kK; e += kThreads) {
      const int m = e / kK, k = e % kK;
      const T* src = rows[lora][m];
      t.a[k][m] = src != nullptr && k0 + k < a_cols ? to_float(src[k0 + k]) : 0.0f;
    }
    for (int e = threadIdx.x; e < kN * kK; e += kThreads) {  // consecutive threads along b's contiguous dim
      const int n = b.ld_k == 1 ? e / kK : e % kN, k = b.ld_k == 1 ? e % kK : e / kN;
      const bool valid = n0 + n < p.n_cols && k0 + k < b.k_limit;
      t.b[k][n] = valid ? to_float(b_expert[(n0 + n) * b.ld_n + (k0 + k) * b.ld_k]) : 0.0f;
    }
    __syncthreads();
    multiply(t, acc);
  }
  // Epilogue; the gate-gradient dot of a row is reduced over its 16 threads (tx) by shuffles.
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t dot_cols = p.n_cols < p.dot_rows.cols ? p.n_cols : p.dot_rows.cols;
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t s = tile.begin + ty + 16 * i;
    const bool in_tile = s < tile.end;
    const float gate = in_tile && p.gate_of_slot != nullptr ? p.gate_of_slot[s] : 1.0f;
    T* out = in_tile ? out_row<T>(p, s) : nullptr;
    const T* dot_row = in_tile && p.dgate_partial != nullptr ? slot_row<T>(p.dot_rows, s) : nullptr;
    float dot = 0.0f;
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      const float value = p.alpha * acc[i][j];
      if (dot_row != nullptr && n < dot_cols) dot += value * to_float(dot_row[n]);
      if (out != nullptr && n < p.n_cols) out[n] = from_float<T>(value * gate);
    }
    for (int offset = 8; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (p.dgate_partial != nullptr && in_tile && tx == 0) p.dgate_partial[tile.column * p.slots + s] = dot;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) weight_grad_kernel(const GroupedWeightGradParams p) {
  __shared__ const T* rows[2][kK];  // the K-tile's slot rows of a and b
  __shared__ Tiles t;
  const int64_t expert = blockIdx.z, m0 = int64_t(blockIdx.x) * kM, n0 = int64_t(blockIdx.y) * kN;
  const SlotRange slots = bucket_slots(p.expert_offsets, p.experts, p.slots, expert);
  float acc[kPerThread][kPerThread] = {};
  for (int64_t s0 = slots.begin; s0 < slots.end; s0 += kK) {
    __syncthreads();  // the previous tile consumed
    if (threadIdx.x < 2 * kK) {
      const int k = threadIdx.x % kK;
      const bool in_range = s0 + k < slots.end;
      rows[threadIdx.x / kK][k] = in_range ? slot_row<T>(threadIdx.x < kK ? p.a : p.b, s0 + k) : nullptr;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kK * kM; e += kThreads) {
      const int k = e / kM, col = e % kM;
      const T* a = rows[0][k];
      const T* b = rows[1][k];
      t.a[k][col] = a != nullptr && m0 + col < p.a.cols ? to_float(a[m0 + col]) : 0.0f;
      t.b[k][col] = b != nullptr && n0 + col < p.b.cols ? to_float(b[n0 + col]) : 0.0f;
    }
    __syncthreads();
    multiply(t, acc);
  }
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  T* out = static_cast<T*>(p.out) + expert * p.expert_stride;
  for (int i = 0; i < kPerThread; ++i) {
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < p.m_rows && n < p.n_cols) out[m * p.ld_m + n * p.ld_n] = from_float<T>(p.alpha * acc[i][j]);
    }
  }
}
static_assert(kM == kN, "weight_grad_kernel loads both operand tiles in one loop");
}  // namespace simt

// ------------------------------------------------------------------ configuration choice
constexpr int kVectorElements = 8;  // 16 bytes of a 16-bit type

bool vector_ok(const void* data, int64_t ld, int64_t extent) {
  return rows_vector_aligned(data, ld, extent, kVectorElements, 2);
}

bool matrix_vector_ok(const ExpertMatrix& b, int64_t n_cols) {
  const bool k_major = b.ld_k == 1;
  return reinterpret_cast<uintptr_t>(b.data) % 16 == 0 && b.expert_stride % kVectorElements == 0 &&
         (k_major ? b.ld_n % kVectorElements == 0 && b.k_limit % kVectorElements == 0
                  : b.ld_k % kVectorElements == 0 && n_cols % kVectorElements == 0);
}

// Tensor cores when the dtype is 16-bit and every 16-byte copy stays inside one row of an operand.
bool tensor_op_rows(const GroupedRowsParams& p) {
  const bool lora = p.a2.cols > 0;
  return p.dtype != DType::kFloat32 && vector_ok(p.a.data, p.a.ld, p.a.cols) && matrix_vector_ok(p.b, p.n_cols) &&
         (!lora || (vector_ok(p.a2.data, p.a2.ld, p.a2.cols) && matrix_vector_ok(p.b2, p.n_cols)));
}

bool tensor_op_weight_grad(const GroupedWeightGradParams& p) {
  return p.dtype != DType::kFloat32 && vector_ok(p.a.data, p.a.ld, p.a.cols) && vector_ok(p.b.data, p.b.ld, p.b.cols);
}

int rows_per_tile(const GroupedRowsParams& p) { return tensor_op_rows(p) ? 128 : simt::kM; }

// Columns per tile: the narrow tile for a rank-r output under PYKERNELS_MOE_RANK_TILE=narrow (moe.h).
int rows_tile_columns(const GroupedRowsParams& p) {
  if (!tensor_op_rows(p)) return simt::kN;
  return p.narrow_rank_tile && p.n_cols <= kNarrowRankColumns ? kNarrowRankColumns : 128;
}

int64_t row_tile_grid(const GroupedRowsParams& p) { return max_row_tiles(p.slots, p.experts, rows_per_tile(p)); }

// Opts a kernel into `smem` bytes of dynamic shared memory (over the 48 KiB static limit) once per
// (kernel, device): the attribute belongs to the function on that device and persists, so setting
// it on every launch only cost a driver call per launch. Keyed by the function's address (kernels
// of one signature share a type); each kernel is launched with one constant size.
cudaError_t allow_dynamic_smem(const void* kernel, size_t smem) {
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;  // (kernel, device)
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device}) != 0) return cudaSuccess;
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status == cudaSuccess) done.insert({kernel, device});
  return status;
}

// Launches a tensor-op kernel with its dynamic shared memory.
template <typename Kernel, typename... Args>
const char* launch_with_smem(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
                             Args... args) {
  const cudaError_t status = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (status != cudaSuccess)
    return fail(std::string("moe: shared memory request failed: ") + cudaGetErrorString(status));
  kernel<<<grid, threads, smem, stream>>>(args...);
  return launch_status("moe: grouped GEMM launch failed");
}

template <typename T, bool kBKMajor, int kTileN>
const char* launch_tensor_op_rows(const GroupedRowsParams& p, const int2* tiles, dim3 grid, cudaStream_t stream) {
  using Cfg = tensor_op::Config<T, kTileN>;
  return launch_with_smem(tensor_op::rows_kernel<T, kBKMajor, kTileN>, grid, Cfg::kThreads,
                          sizeof(tensor_op::RowsSmem<Cfg, kBKMajor>), stream, p, tiles);
}

template <typename T>
const char* launch_rows_kernel(const GroupedRowsParams& p, const int2* tiles, dim3 grid, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_op_rows(p)) {
      const bool k_major = p.b.ld_k == 1;
      if (rows_tile_columns(p) == kNarrowRankColumns)
        return k_major ? launch_tensor_op_rows<T, true, kNarrowRankColumns>(p, tiles, grid, stream)
                       : launch_tensor_op_rows<T, false, kNarrowRankColumns>(p, tiles, grid, stream);
      return k_major ? launch_tensor_op_rows<T, true, 128>(p, tiles, grid, stream)
                     : launch_tensor_op_rows<T, false, 128>(p, tiles, grid, stream);
    }
  }
  simt::rows_kernel<T><<<grid, simt::kThreads, 0, stream>>>(p, tiles);
  return launch_status("moe: grouped GEMM launch failed");
}

const char* check_rows_operands(const GroupedRowsParams& p) {
  const bool k_major = p.b.ld_k == 1;
  if (!k_major && p.b.ld_n != 1) return "moe grouped rows: b must have ld_k == 1 or ld_n == 1";
  if (p.a2.cols > 0 && (p.b2.ld_k == 1) != k_major) return "moe grouped rows: b2 must be stored like b";
  if (p.a2.cols > 0 && !k_major && p.b2.ld_n != 1) return "moe grouped rows: b2 must have ld_k == 1 or ld_n == 1";
  if (p.dgate_partial != nullptr && p.dot_rows.data == nullptr) return "moe grouped rows: dgate needs dot_rows";
  return nullptr;
}

}  // namespace

// ------------------------------------------------------------------ launchers
int64_t grouped_rows_column_tiles(const GroupedRowsParams& p) { return ceil_div(p.n_cols, rows_tile_columns(p)); }

int64_t grouped_rows_workspace_bytes(const GroupedRowsParams& p) {
  return (p.experts + 2) * int64_t(sizeof(int64_t)) + row_tile_grid(p) * int64_t(sizeof(int2));
}

const char* launch_grouped_rows(const GroupedRowsParams& p, void* workspace, cudaStream_t stream) {
  if (const char* error = check_rows_operands(p)) return error;
  if (p.slots > INT32_MAX) return "moe grouped rows: T * k must be < 2^31";
  if (p.slots == 0 || p.n_cols == 0) return nullptr;
  const int64_t column_tiles = grouped_rows_column_tiles(p), row_tiles = row_tile_grid(p);
  if (row_tiles * column_tiles > INT32_MAX) return "moe grouped rows: output too large for one launch";
  int64_t* tile_start = static_cast<int64_t*>(workspace);
  int2* tiles = reinterpret_cast<int2*>(tile_start + p.experts + 2);
  tile_schedule_kernel<<<1, kScanThreads, 0, stream>>>(p.expert_offsets, p.experts, p.slots, rows_per_tile(p),
                                                       tile_start, tiles, row_tiles);
  if (const char* error = launch_status("moe grouped rows: schedule launch failed")) return error;
  const dim3 grid(static_cast<unsigned>(row_tiles * column_tiles));  // grid_tile: column tiles innermost
  return with_element(p.dtype, [&](auto element) {
    return launch_rows_kernel<decltype(element)>(p, tiles, grid, stream);
  });
}

const char* launch_grouped_weight_grad(const GroupedWeightGradParams& params, cudaStream_t stream) {
  GroupedWeightGradParams p = params;
  if (p.m_rows == 0 || p.n_cols == 0 || p.experts == 0) return nullptr;
  const bool tensor_op = tensor_op_weight_grad(p);
  // The narrow tile (PYKERNELS_MOE_RANK_TILE=narrow, moe.h) puts the rank side on its 32 columns: dB_e
  // [out, r] as it is, dA_e [r, in] as its transpose (the operands and output strides swapped).
  const bool narrow = tensor_op && p.narrow_rank_tile && std::min(p.m_rows, p.n_cols) <= kNarrowRankColumns;
  if (narrow && p.n_cols > p.m_rows) {
    std::swap(p.a, p.b);
    std::swap(p.m_rows, p.n_cols);
    std::swap(p.ld_m, p.ld_n);
  }
  const int64_t tile = tensor_op ? 128 : simt::kM;
  const int64_t m_tiles = ceil_div(p.m_rows, tile), n_tiles = ceil_div(p.n_cols, narrow ? kNarrowRankColumns : tile);
  if (m_tiles > INT32_MAX || n_tiles > 65535 || p.experts > 65535)
    return "moe weight grad: output too large for one launch";
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>(n_tiles), static_cast<unsigned>(p.experts));
  return with_element(p.dtype, [&](auto element) -> const char* {
    using T = decltype(element);
    if constexpr (!std::is_same_v<T, float>) {
      if (narrow) {  // tensor_op too
        using Cfg = tensor_op::Config<T, kNarrowRankColumns>;
        return launch_with_smem(tensor_op::weight_grad_kernel<T, kNarrowRankColumns>, grid, Cfg::kThreads,
                                sizeof(tensor_op::Pipeline<Cfg, false, false>), stream, p);
      }
      if (tensor_op) {
        using Cfg = tensor_op::Config<T>;
        return launch_with_smem(tensor_op::weight_grad_kernel<T, 128>, grid, Cfg::kThreads,
                                sizeof(tensor_op::Pipeline<Cfg, false, false>), stream, p);
      }
    }
    simt::weight_grad_kernel<T><<<grid, simt::kThreads, 0, stream>>>(p);
    return launch_status("moe weight grad: kernel launch failed");
  });
}

}  // namespace pykernels::moe
