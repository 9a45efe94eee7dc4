// The LoRA forward on Hopper (what it computes and why: lora_forward_sm90.h): one CUTLASS 3.x
// cooperative GEMM whose mainloop takes k tiles from (x, W) and then from (U, V)
// (common/extended_k_mainloop_sm90.cuh), with D = acc stored in bf16 by TMA.
//
// Compiled for sm_90a alone (cmake/sm90_sources.cmake); without PYKERNELS_SM90A_GEMM the launcher
// reports that the kernel is not built.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "lora/lora_forward_sm90.h"

#ifdef PYKERNELS_SM90A_GEMM
#include "common/cutlass_sm90.cuh"
#include "common/extended_k_mainloop_sm90.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace pykernels::lora {
namespace {

const char* failure(std::string message) {
  thread_local std::string last;
  last = "LoRA forward (sm_90a): " + std::move(message);
  return last.c_str();
}

#ifdef PYKERNELS_SM90A_GEMM
using namespace cute;
using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;
static_assert(size<2>(TileShape{}) == kExtendedKTile, "U and V are padded to the mainloop's K tile");

// D = acc (alpha 1): no C operand, so the epilogue loads nothing.
using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::ScaledAcc<Element, float>>::CollectiveOp;

// x row-major [m, k]; W [n, k] is B in K-major (column-major) form; likewise U and V.
using BaseMainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Mainloop = gemm::ExtendedKMainloop<BaseMainloop>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

Gemm::Arguments arguments(const LoraForwardSm90Params& p, int device) {
  using StrideA = Kernel::StrideA;
  using StrideB = Kernel::StrideB;
  const int k_total = static_cast<int>(ceil_div(p.k, kExtendedKTile) * kExtendedKTile + p.extra_k);
  Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(p.m), static_cast<int>(p.n), k_total, 1};
  auto& mainloop = args.mainloop;
  mainloop.ptr_A = static_cast<const Element*>(p.x);
  mainloop.dA = gemm::leading_stride<StrideA>(p.ldx);
  mainloop.ptr_B = static_cast<const Element*>(p.w);
  mainloop.dB = gemm::leading_stride<StrideB>(p.ldw);
  mainloop.ptr_A2 = static_cast<const Element*>(p.u);
  mainloop.dA2 = gemm::leading_stride<StrideA>(p.extra_k);
  mainloop.ptr_B2 = static_cast<const Element*>(p.v);
  mainloop.dB2 = gemm::leading_stride<StrideB>(p.extra_k);
  mainloop.k1 = static_cast<int>(p.k);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.ptr_D = static_cast<Element*>(p.y);
  args.epilogue.dD = gemm::leading_stride<Kernel::StrideD>(p.ldy);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return args;
}
#endif  // PYKERNELS_SM90A_GEMM

}  // namespace

bool lora_forward_sm90_built() {
#ifdef PYKERNELS_SM90A_GEMM
  return true;
#else
  return false;
#endif
}

int64_t lora_forward_sm90_workspace_bytes(const LoraForwardSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return int64_t(Gemm::get_workspace_size(arguments(p, device)));
#else
  return 0;
#endif
}

const char* launch_lora_forward_sm90(const LoraForwardSm90Params& p, void* workspace, int device, cudaStream_t stream) {
  if (const char* error = lora_forward_sm90_error(p)) return failure(error);
#ifdef PYKERNELS_SM90A_GEMM
  const std::string error = gemm::run_cutlass_gemm<Gemm>(arguments(p, device), workspace, stream);
  return error.empty() ? nullptr : failure(error);
#else
  (void)workspace, (void)device, (void)stream;
  return failure("not built (the extension's CUDA archs do not include 90a)");
#endif
}

}  // namespace pykernels::lora
