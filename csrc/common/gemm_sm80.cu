// The sm80 GEMM (gemm_sm80.h): one wrapper over CUTLASS 2.x device::GemmUniversal.
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
#include "common/gemm_sm80.h"
#include "common/tails.h"

namespace pykernels::gemm {
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
    return fail("gemm: alignment of an operand not supported by " + what());
  // C is never read when beta == 0; D stands in for a null C so no null pointer reaches CUTLASS.
  const bool has_c = p.beta != 0.0f;
  typename Gemm::Arguments args(cutlass::gemm::GemmUniversalMode::kGemm,
                                {int(p.m), int(p.n), int(p.k)}, /*batch_count=*/1, {p.alpha, p.beta},
                                p.a, p.b, has_c ? p.c : p.d, p.d,
                                /*batch strides A, B, C, D=*/0, 0, 0, 0,
                                p.lda, p.ldb, has_c ? p.ldc : p.ldd, p.ldd);
  cutlass::Status status = Gemm::can_implement(args);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("gemm: can_implement failed (") + cutlass::cutlassGetStatusString(status) +
                ") for " + what());
  if (Gemm::get_workspace_size(args) != 0)
    return fail("gemm: unexpected workspace request (no split-K is configured) for " + what());
  Gemm gemm;
  status = gemm.initialize(args, /*workspace=*/nullptr, stream);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("gemm: initialize failed (") + cutlass::cutlassGetStatusString(status) +
                ") for " + what());
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return fail(std::string("gemm: kernel launch failed (") + cutlass::cutlassGetStatusString(status) +
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
  return "gemm: a_transposed and b_transposed together are not instantiated (layouts: x W^T, dy W, dy^T xa)";
}

template <DType kAB>
const char* dispatch_output(const GemmParams& p, cudaStream_t stream) {
  using ElementAB = typename CutlassElement<kAB>::type;
  if (p.d_dtype == DType::kFloat32) return dispatch_layout<ElementAB, float>(p, stream);
  if (p.d_dtype == kAB) return dispatch_layout<ElementAB, ElementAB>(p, stream);
  return "gemm: d_dtype must be ab_dtype or float32";
}

constexpr int kThreads = 256;  // the k == 0 kernel

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

}  // namespace

const char* launch_gemm(const GemmParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX)
    return fail("gemm: m, n, k must be in [0, 2^31)," + describe(p));
  if (p.d_dtype != DType::kFloat32 && p.d_dtype != p.ab_dtype)
    return "gemm: d_dtype must be ab_dtype or float32";
  if (p.m == 0 || p.n == 0) return nullptr;  // before the pointer checks: an empty tensor's data is null
  if (p.beta != 0.0f && p.c == nullptr) return "gemm: c is null but beta is not 0";
  if (p.d == nullptr || p.ldd < p.n || (p.beta != 0.0f && p.ldc < p.n))
    return fail("gemm: d must be non-null with ldd >= n (and ldc >= n when beta != 0);" + describe(p));
  if (p.k == 0) {  // an empty product: D = beta * C (CUTLASS's k == 0 path is not relied on)
    return with_element(p.d_dtype, [&](auto element) {
      using T = decltype(element);
      scale_kernel<T><<<grid_for(p.m * p.n, kThreads), kThreads, 0, stream>>>(
          static_cast<const T*>(p.c), p.ldc, p.beta, p.m, p.n, static_cast<T*>(p.d), p.ldd);
      return launch_status("gemm: k == 0 scale kernel launch failed");
    });
  }
  const int64_t a_extent = p.a_transposed ? p.m : p.k;
  const int64_t b_extent = p.b_transposed ? p.k : p.n;
  if (p.a == nullptr || p.b == nullptr || p.lda < a_extent || p.ldb < b_extent)
    return fail("gemm: a and b must be non-null with lda, ldb >= their rows' length;" + describe(p));
  switch (p.ab_dtype) {
    case DType::kFloat32: return dispatch_output<DType::kFloat32>(p, stream);
    case DType::kFloat16: return dispatch_output<DType::kFloat16>(p, stream);
    case DType::kBFloat16: return dispatch_output<DType::kBFloat16>(p, stream);
  }
  return "gemm: unknown ab_dtype";
}

}  // namespace pykernels::gemm
