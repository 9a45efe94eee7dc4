// The Hopper QLoRA GEMM (the math and the operands in nf4_gemm_sm90.h): CUTLASS's mixed-input
// mainloop, given the NF4 codes as a 4-bit type of their own whose conversion to fp32 is the
// register decode of nf4_decode_bf16.h (bf16 code values, widened), and the blocks' fp32 absmax as
// its group-wise scale (ConvertAndScale, group = blocksize along k): CUTLASS multiplies in fp32 and
// rounds each weight to bf16 for wgmma.
//
// CUTLASS puts the narrow operand in registers as wgmma's A, so the GEMM runs transposed:
// D [n, m] = W [n, k] . x [m, k]^T, with D column-major of leading dimension n, which is y [m, n]
// row-major. CUTLASS sees element 2j of a byte in its low nibble, bitsandbytes in its high one; the
// decode swaps each byte's pair, which is exact because every register fragment the mainloop
// converts holds whole bytes of one row (wgmma's A layout: pairs of adjacent k).
//
// Compiled for sm_90a alone (cmake/sm90_sources.cmake); without PYKERNELS_SM90A_GEMM the launcher
// reports that the kernel is not built.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "nf4/nf4_gemm_sm90.h"

#ifdef PYKERNELS_SM90A_GEMM
#include "common/cutlass_sm90.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/integer_subbyte.h"
#include "cutlass/numeric_conversion.h"
#include "nf4/nf4_decode_bf16.h"

namespace pykernels::nf4 {

// A 4-bit NF4 code: CUTLASS's unsigned 4-bit storage under its own name, so that its conversion
// is the table decode below and not the integer one.
struct Nf4Code : cutlass::uint4b_t {
  Nf4Code() = default;
  CUTLASS_HOST_DEVICE explicit Nf4Code(cutlass::uint4b_t bits) : cutlass::uint4b_t(bits) {}
  CUTLASS_HOST_DEVICE explicit Nf4Code(unsigned bits) : cutlass::uint4b_t(bits) {}
};

}  // namespace pykernels::nf4

template <>
struct cutlass::sizeof_bits<pykernels::nf4::Nf4Code> {
  static constexpr int value = 4;
};

// Codes to their code values in fp32, 8 per 32-bit word (the mainloop converts a register at a
// time): the bf16 decode widened, exact, before the fp32 multiply by the block's absmax.
template <int N, cutlass::FloatRoundStyle Round>
struct cutlass::NumericArrayConverter<float, pykernels::nf4::Nf4Code, N, Round> {
  static_assert(N % 8 == 0, "NF4 codes decode in whole 32-bit words");
  using result_type = cutlass::Array<float, N>;
  using source_type = cutlass::Array<pykernels::nf4::Nf4Code, N>;
  static FloatRoundStyle const round_style = Round;

  CUTLASS_DEVICE static result_type convert(source_type const& source) {
    result_type result;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&source);
    uint32_t* out = reinterpret_cast<uint32_t*>(&result);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N / 8; ++i) {
      uint32_t pairs[4];
      pykernels::nf4::decode_nf4_word_bf16(words[i], pairs);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        out[8 * i + 2 * j] = pairs[j] << 16;              // element 2j: the low half
        out[8 * i + 2 * j + 1] = pairs[j] & 0xFFFF0000u;  // element 2j + 1: the high half
      }
    }
    return result;
  }

  CUTLASS_DEVICE result_type operator()(source_type const& s) const { return convert(s); }
};

namespace pykernels::nf4 {
namespace {
using namespace cute;

using Bf16 = cutlass::bfloat16_t;
// 256 tokens per tile: a consumer decodes its 64 x 64 codes per k tile whatever the tile's N, so the
// wider tile halves the decode's share of the issue slots and the reads of W (an estimate from the
// PTX: ~200 decode instructions per thread per k tile, against ~512 issue slots per warp while the
// tile's wgmma runs at 128 x 256, 256 at 128 x 128). ptxas reports no spill at this size.
using TileShape = Shape<_128, _256, Int<kNf4GemmTileK>>;
using ClusterShape = Shape<_1, _1, _1>;
using LayoutW = cutlass::layout::RowMajor;     // W [n, k]: K-major, the GEMM's A
using LayoutX = cutlass::layout::ColumnMajor;  // x [m, k] as the GEMM's B [N = m, K]: K-major
using LayoutY = cutlass::layout::ColumnMajor;  // D [n, m] column-major = y [m, n] row-major

// The cooperative schedule: the only epilogue that supports the transposed output (example 55).
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Bf16, LayoutY, 8, Bf16, LayoutY, 8,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cute::tuple<Nf4Code, float>, LayoutW, 32, Bf16, LayoutX, 8,
    float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

Gemm::Arguments arguments(const Nf4GemmSm90Params& p, int device) {
  const int n = static_cast<int>(p.n), m = static_cast<int>(p.m), k = static_cast<int>(p.k);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  using StrideW = typename Kernel::StrideA;
  using StrideX = typename Kernel::StrideB;
  using StrideY = typename Kernel::StrideD;
  using StrideScale = typename Mainloop::StrideScale;
  Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {n, m, k, 1};
  args.mainloop.ptr_A = reinterpret_cast<const Nf4Code*>(p.packed);
  args.mainloop.dA = gemm::leading_stride<StrideW>(p.k);
  args.mainloop.ptr_B = static_cast<const Bf16*>(p.x);
  args.mainloop.dB = gemm::leading_stride<StrideX>(p.k);
  args.mainloop.ptr_S = static_cast<const float*>(p.scales);
  args.mainloop.dS = gemm::leading_stride<StrideScale>(p.n);
  args.mainloop.group_size = static_cast<int>(p.blocksize);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = p.beta;
  args.epilogue.ptr_C = p.beta != 0.0f ? static_cast<const Bf16*>(p.y) : nullptr;
  args.epilogue.dC = gemm::leading_stride<StrideY>(p.n);
  args.epilogue.ptr_D = static_cast<Bf16*>(p.y);
  args.epilogue.dD = args.epilogue.dC;
  args.hw_info = hw;
  return args;
}

const char* failure(std::string message) {
  thread_local std::string last;
  last = "NF4 GEMM (sm_90a): " + std::move(message);
  return last.c_str();
}

}  // namespace

bool nf4_gemm_sm90_built() { return true; }

int64_t nf4_gemm_sm90_workspace_bytes(const Nf4GemmSm90Params& p, int device) {
  if (nf4_gemm_sm90_error(p) != nullptr) return 0;
  return static_cast<int64_t>(Gemm::get_workspace_size(arguments(p, device)));
}

const char* run_nf4_gemm_sm90(const Nf4GemmSm90Params& p, void* workspace, int device, cudaStream_t stream) {
  if (const char* error = nf4_gemm_sm90_error(p)) return failure(error);
  if (std::string error = gemm::run_cutlass_gemm<Gemm>(arguments(p, device), workspace, stream); !error.empty())
    return failure(std::move(error));
  return nullptr;
}

}  // namespace pykernels::nf4

#else  // not built for sm_90a

namespace pykernels::nf4 {

bool nf4_gemm_sm90_built() { return false; }

int64_t nf4_gemm_sm90_workspace_bytes(const Nf4GemmSm90Params&, int) { return 0; }

const char* run_nf4_gemm_sm90(const Nf4GemmSm90Params&, void*, int, cudaStream_t) {
  return "NF4 GEMM (sm_90a): not built (this build's CUDA archs do not include sm_90a)";
}

}  // namespace pykernels::nf4

#endif  // PYKERNELS_SM90A_GEMM
