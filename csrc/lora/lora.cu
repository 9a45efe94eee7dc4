// Fused LoRA CUDA kernels (declarations and the math in lora.h): one GEMM wrapper over CUTLASS 2.x
// device::GemmUniversal, and small kernels: the rank-r LoRA term, rank-r GEMMs of mixed dtypes
// (fp32 LoRA weights and intermediates against 16-bit activations) and dtype casts.
//
// The GEMM picks one of two configurations at run time:
//   - sm80 tensor cores (mma.sync m16n8k16, fp32 accumulation) for 16-bit operands whose pointers,
//     leading dimensions and contiguous extents all allow 128-bit accesses: the model-sized case;
//   - CUTLASS's SIMT kernel with element-wise accesses otherwise: fp32 operands (true fp32 FMA, no
//     TF32, like torch's default) and 16-bit operands with an odd size or offset (K = 769, r = 1).
// Both are sm80 kernels, which also run on sm90. Compile time grows with every instantiation
// (27 GEMMs: 3 layouts x {bf16, fp16} x {16-bit, fp32 out} x 2 configs, and 3 layouts of fp32
// SIMT; under a minute per arch), so the set is kept to the layouts the ops use:
//   (a_transposed, b_transposed) = (false, true)   x W^T, x_lora A^T
//                                  (false, false)  dy W, dy B, dxa A
//                                  (true, false)   dy^T xa, dxa^T x_lora
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/numeric_types.h"

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "common/tails.h"
#include "lora/lora.h"

namespace pykernels::lora {
namespace {

// ------------------------------------------------------------------ GEMM types
using ElementAccumulator = float;                    // every product accumulates in fp32
using ElementCompute = float;                        // alpha * acc + beta * C in fp32, rounded once
using ArchTag = cutlass::arch::Sm80;                 // mma.sync / cp.async kernels; run on sm80 and sm90
using LayoutD = cutlass::layout::RowMajor;           // C and D: [m, n] row-major
using Swizzle = cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>;  // no split-K: no workspace

// op_a(A) [m, k]: stored [m, k] row-major, or transposed: stored [k, m] = [m, k] column-major.
template <bool kTransposed>
using LayoutA = std::conditional_t<kTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
// op_b(B) [k, n]: stored [k, n] row-major, or transposed: stored [n, k] = [k, n] column-major.
template <bool kTransposed>
using LayoutB = std::conditional_t<kTransposed, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

template <DType> struct CutlassElement;
template <> struct CutlassElement<DType::kFloat32> { using type = float; };
template <> struct CutlassElement<DType::kFloat16> { using type = cutlass::half_t; };
template <> struct CutlassElement<DType::kBFloat16> { using type = cutlass::bfloat16_t; };

// 16-bit A/B with every operand allowing 128-bit accesses: the base GEMMs x W^T and dy W and the
// rank-r products at model sizes (K, N, r multiples of 8). The CUTLASS profiler's
// cutlass_tensorop_s16816gemm_*_128x128_32x4 (example 47's configuration), sm80's workhorse.
template <typename ElementAB_, typename ElementD_>
struct TensorOpConfig {
  using ElementAB = ElementAB_;                                   // cutlass::half_t or bfloat16_t
  using ElementD = ElementD_;                                     // ElementAB or float
  using OperatorClass = cutlass::arch::OpClassTensorOp;
  using ThreadblockShape = cutlass::gemm::GemmShape<128, 128, 32>;  // 4 warps of 64 x 64
  using WarpShape = cutlass::gemm::GemmShape<64, 64, 32>;
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;   // mma.sync.m16n8k16, fp32 accumulate
  static constexpr int kStages = 4;                               // cp.async pipeline: 64 KiB of smem
  static constexpr int kAlignmentAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 8 elements
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;    // 8 (16-bit) or 4 (fp32)
  static constexpr const char* kName = "tensorop 128x128x32 s4";
};

// Everything else: fp32 A/B (full fp32 FMA, no TF32) and 16-bit operands that are not 128-bit
// aligned. The CUTLASS profiler's cutlass_simt_sgemm_128x128_8x2 with element-wise accesses
// (alignment 1), so any size, offset and leading dimension works.
template <typename ElementAB_, typename ElementD_>
struct SimtConfig {
  using ElementAB = ElementAB_;                                   // float, cutlass::half_t or bfloat16_t
  using ElementD = ElementD_;                                     // ElementAB or float
  using OperatorClass = cutlass::arch::OpClassSimt;
  using ThreadblockShape = cutlass::gemm::GemmShape<128, 128, 8>;  // 8 warps of 32 x 64
  using WarpShape = cutlass::gemm::GemmShape<32, 64, 8>;
  using InstructionShape = cutlass::gemm::GemmShape<1, 1, 1>;     // scalar fp32 FMA
  static constexpr int kStages = 2;                               // register-staged double buffer
  static constexpr int kAlignmentAB = 1;
  static constexpr int kAlignmentD = 1;
  static constexpr const char* kName = "simt 128x128x8 s2";
};

template <typename Config, bool kTransposeA, bool kTransposeB>
using DeviceGemm = cutlass::gemm::device::GemmUniversal<
    typename Config::ElementAB, LayoutA<kTransposeA>,             // A
    typename Config::ElementAB, LayoutB<kTransposeB>,             // B
    typename Config::ElementD, LayoutD,                           // C and D
    ElementAccumulator, typename Config::OperatorClass, ArchTag,
    typename Config::ThreadblockShape, typename Config::WarpShape, typename Config::InstructionShape,
    cutlass::epilogue::thread::LinearCombination<typename Config::ElementD, Config::kAlignmentD,
                                                 ElementAccumulator, ElementCompute>,  // beta == 0: C not read
    Swizzle, Config::kStages, Config::kAlignmentAB, Config::kAlignmentAB>;

// ------------------------------------------------------------------ GEMM launch

std::string describe(const GemmParams& p) {
  return " (m, n, k) = (" + std::to_string(p.m) + ", " + std::to_string(p.n) + ", " + std::to_string(p.k) +
         "), lda " + std::to_string(p.lda) + ", ldb " + std::to_string(p.ldb) + ", ldc " + std::to_string(p.ldc) +
         ", ldd " + std::to_string(p.ldd) + ", a_transposed " + std::to_string(p.a_transposed) +
         ", b_transposed " + std::to_string(p.b_transposed);
}

// CUTLASS predicates whole vectors, and its can_implement checks only the extents: the pointer,
// the leading dimension and the contiguous extent must all be multiples of the access width
// (rows_vector_aligned, common/tails.h).
template <typename Config>
bool operands_fit(const GemmParams& p) {
  constexpr int ab_bytes = sizeof(typename Config::ElementAB);
  constexpr int d_bytes = sizeof(typename Config::ElementD);
  const bool a = rows_vector_aligned(p.a, p.lda, p.a_transposed ? p.m : p.k, Config::kAlignmentAB, ab_bytes);
  const bool b = rows_vector_aligned(p.b, p.ldb, p.b_transposed ? p.k : p.n, Config::kAlignmentAB, ab_bytes);
  const bool c = p.beta == 0.0f || rows_vector_aligned(p.c, p.ldc, p.n, Config::kAlignmentD, d_bytes);
  const bool d = rows_vector_aligned(p.d, p.ldd, p.n, Config::kAlignmentD, d_bytes);
  return a && b && c && d;
}

// can_implement -> get_workspace_size -> initialize -> run, every failure turned into a message.
template <typename Config, bool kTransposeA, bool kTransposeB>
const char* run_gemm(const GemmParams& p, cudaStream_t stream) {
  using Gemm = DeviceGemm<Config, kTransposeA, kTransposeB>;
  const auto what = [&] { return std::string(Config::kName) + describe(p); };  // built only on failure
  if (!operands_fit<Config>(p))
    return fail("lora gemm: alignment of an operand not supported by " + what());
  // C is never read when beta == 0; D stands in for a null C so no null pointer reaches CUTLASS.
  const bool has_c = p.beta != 0.0f;
  typename Gemm::Arguments args(cutlass::gemm::GemmUniversalMode::kGemm,
                                {int(p.m), int(p.n), int(p.k)}, /*batch_count=*/1, {p.alpha, p.beta},
                                p.a, p.b, has_c ? p.c : p.d, p.d,
                                /*batch strides A, B, C, D=*/0, 0, 0, 0,
                                p.lda, p.ldb, has_c ? p.ldc : p.ldd, p.ldd);
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("lora gemm: can_implement failed (") + cutlass::cutlassGetStatusString(status) +
                ") for " + what());
  if (Gemm::get_workspace_size(args) != 0)
    return fail("lora gemm: unexpected workspace request (no split-K is configured) for " + what());
  Gemm gemm;
  status = gemm.initialize(args, /*workspace=*/nullptr, stream);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("lora gemm: initialize failed (") + cutlass::cutlassGetStatusString(status) +
                ") for " + what());
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("lora gemm: kernel launch failed (") + cutlass::cutlassGetStatusString(status) +
                ") for " + what());
  return nullptr;
}

template <typename ElementAB, typename ElementD, bool kTransposeA, bool kTransposeB>
const char* dispatch_config(const GemmParams& p, cudaStream_t stream) {
  if constexpr (!std::is_same_v<ElementAB, float>) {
    using TensorOp = TensorOpConfig<ElementAB, ElementD>;
    if (operands_fit<TensorOp>(p)) return run_gemm<TensorOp, kTransposeA, kTransposeB>(p, stream);
  }
  return run_gemm<SimtConfig<ElementAB, ElementD>, kTransposeA, kTransposeB>(p, stream);
}

template <typename ElementAB, typename ElementD>
const char* dispatch_layout(const GemmParams& p, cudaStream_t stream) {
  if (!p.a_transposed && p.b_transposed) return dispatch_config<ElementAB, ElementD, false, true>(p, stream);
  if (!p.a_transposed && !p.b_transposed) return dispatch_config<ElementAB, ElementD, false, false>(p, stream);
  if (p.a_transposed && !p.b_transposed) return dispatch_config<ElementAB, ElementD, true, false>(p, stream);
  return "lora gemm: a_transposed and b_transposed together are not instantiated (layouts: x W^T, dy W, dy^T xa)";
}

template <DType kAB>
const char* dispatch_output(const GemmParams& p, cudaStream_t stream) {
  using ElementAB = typename CutlassElement<kAB>::type;
  if (p.d_dtype == DType::kFloat32) return dispatch_layout<ElementAB, float>(p, stream);
  if (p.d_dtype == kAB) return dispatch_layout<ElementAB, ElementAB>(p, stream);
  return "lora gemm: d_dtype must be ab_dtype or float32";
}

constexpr int kThreads = 256;


// ------------------------------------------------------------------ k == 0: D = beta * C
// No __restrict__: c may alias d.
template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(const T* c, int64_t ldc,  // [m, n], or null
                                                         float beta, int64_t m, int64_t n,
                                                         T* d, int64_t ldd) {      // [m, n]
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < m * n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n, col = i % n;
    const float value = (beta == 0.0f || c == nullptr) ? 0.0f : beta * to_float(c[row * ldc + col]);
    d[row * ldd + col] = from_float<T>(value);  // in place when c == d: each element read then written once
  }
}

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
// 16 x 16 grid accumulates rows ty + 16 i and columns tx + 16 j in fp32. Unsplit, the CTA writes
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
__device__ __forceinline__ void load_rank_tile(float (*tile)[kExtent + 1], const void* data, DType dtype,
                                               int64_t row0, int64_t rows, int64_t stride_row, int64_t k0,
                                               int64_t k, int64_t stride_k) {
  const bool k_contiguous = stride_k == 1;
  for (int e = threadIdx.x; e < kExtent * kSlice; e += kThreads) {
    const int local = k_contiguous ? e / kSlice : e % kExtent;
    const int kk = k_contiguous ? e % kSlice : e / kExtent;
    const int64_t row = row0 + local, kg = k0 + kk;
    tile[kk][local] = (row < rows && kg < k) ? load_as_float(data, dtype, row * stride_row + kg * stride_k) : 0.0f;
  }
}

template <int kTileM, int kTileN>
__global__ void __launch_bounds__(kThreads) rank_gemm_kernel(RankGemmParams p, int64_t k_per_split) {
  using Tile = RankTileShape<kTileM, kTileN>;
  __shared__ float a_tile[Tile::kSlice][kTileM + 1];  // [kk][row of D]
  __shared__ float b_tile[Tile::kSlice][kTileN + 1];  // [kk][column of D]
  const int64_t row0 = int64_t(blockIdx.x) * kTileM;
  const int64_t col0 = int64_t(blockIdx.y) * kTileN;
  const int64_t k_begin = int64_t(blockIdx.z) * k_per_split;
  const int64_t k_end = min_i64(p.k, k_begin + k_per_split);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[Tile::kRowsPerThread][Tile::kColsPerThread] = {};
  for (int64_t k0 = k_begin; k0 < k_end; k0 += Tile::kSlice) {
    load_rank_tile<kTileM, Tile::kSlice>(a_tile, p.a, p.a_dtype, row0, p.m, p.a_stride_m, k0, k_end, p.a_stride_k);
    load_rank_tile<kTileN, Tile::kSlice>(b_tile, p.b, p.b_dtype, col0, p.n, p.b_stride_n, k0, k_end, p.b_stride_k);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < Tile::kSlice; ++kk) {
      float a_values[Tile::kRowsPerThread], b_values[Tile::kColsPerThread];
#pragma unroll
      for (int i = 0; i < Tile::kRowsPerThread; ++i) a_values[i] = a_tile[kk][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < Tile::kColsPerThread; ++j) b_values[j] = b_tile[kk][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < Tile::kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < Tile::kColsPerThread; ++j) acc[i][j] = fmaf(a_values[i], b_values[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {
    const int64_t row = row0 + ty + 16 * i;
    if (row >= p.m) continue;
#pragma unroll
    for (int j = 0; j < Tile::kColsPerThread; ++j) {
      const int64_t col = col0 + tx + 16 * j;
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

// ------------------------------------------------------------------ casts
template <typename TSrc, typename TDst>
__global__ void __launch_bounds__(kThreads) cast_kernel(const TSrc* __restrict__ src, TDst* __restrict__ dst,
                                                        int64_t numel) {  // [numel] each
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_float<TDst>(to_float(src[i]));  // every 16-bit value is exact in fp32: one rounding
}

}  // namespace

const char* launch_gemm(const GemmParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
    return fail("lora gemm: m, n, k must be in [0, 2^31)," + describe(p));
  if (p.d_dtype != DType::kFloat32 && p.d_dtype != p.ab_dtype)
    return "lora gemm: d_dtype must be ab_dtype or float32";
  if (p.m == 0 || p.n == 0) return nullptr;  // before the pointer checks: an empty tensor's data is null
  if (p.beta != 0.0f && p.c == nullptr) return "lora gemm: c is null but beta is not 0";
  if (p.d == nullptr || p.ldd < p.n || (p.beta != 0.0f && p.ldc < p.n))
    return fail("lora gemm: d must be non-null with ldd >= n (and ldc >= n when beta != 0);" + describe(p));
  if (p.k == 0) {  // an empty product: D = beta * C (CUTLASS's k == 0 path is not relied on)
    return with_element(p.d_dtype, [&](auto element) {
      using T = decltype(element);
      scale_kernel<T><<<grid_for(p.m * p.n, kThreads), kThreads, 0, stream>>>(static_cast<const T*>(p.c), p.ldc, p.beta, p.m,
                                                                     p.n, static_cast<T*>(p.d), p.ldd);
      return launch_status("lora gemm: k == 0 scale kernel launch failed");
    });
  }
  const int64_t a_extent = p.a_transposed ? p.m : p.k;
  const int64_t b_extent = p.b_transposed ? p.k : p.n;
  if (p.a == nullptr || p.b == nullptr || p.lda < a_extent || p.ldb < b_extent)
    return fail("lora gemm: a and b must be non-null with lda, ldb >= their rows' length;" + describe(p));
  switch (p.ab_dtype) {
    case DType::kFloat32: return dispatch_output<DType::kFloat32>(p, stream);
    case DType::kFloat16: return dispatch_output<DType::kFloat16>(p, stream);
    case DType::kBFloat16: return dispatch_output<DType::kBFloat16>(p, stream);
  }
  return "lora gemm: unknown ab_dtype";
}

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
