// The LoRA forward's GEMM on CUTLASS's plain (one problem) kernel, PYKERNELS_SM90_DENSE=plain
// (common/sm90_dense_plain.h says which calls it takes): D[s, :n] = alpha (A[s, :k] B^T + A2[s, :k2] B2^T)
// + beta C[s], B and B2 K-major ([n, k], [n, k2]), bf16 operands and D, fp32 accumulation, on the core's
// 128x256x64 cooperative tile with a 2x1 cluster, K over both pairs (extended_k_mainloop_sm90.cuh). The
// problem's shape is known on the host, so CUTLASS's persistent scheduler sizes the grid to it; its walk
// over the tiles is p.order's (PYKERNELS_SM90_RASTER), as on the array kernel, so the two compare on the
// same walk. No workspace beyond CUTLASS's own.
#ifdef PYKERNELS_SM90A_GEMM

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cutlass_sm90.cuh"
#include "common/extended_k_mainloop_sm90.cuh"
#include "common/gemm_groups.h"
#include "common/grouped_gemm_sm90.h"
#include "common/grouped_gemm_sm90_tiles.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace pykernels::gemm {
namespace {
using namespace cute;

using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_2, _1, _1>;

using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<Element, float>>::CollectiveOp;

using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = ExtendedKMainloop<BaseMainloop>;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

typename Gemm::Arguments arguments(const GroupedGemmSm90Params& p, int device) {
  const auto dD = leading_stride<typename Kernel::StrideD>(p.ldd);
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  // both pairs in whole k tiles, as the array kernel's one group gets them (host-tested there)
  const int64_t k = extra_k_group(nullptr, 1, p.slots, 0, p.k, p.k2, p.lda2, 0, size<2>(TileShape{})).k;
  args.problem_shape = {static_cast<int>(p.slots), static_cast<int>(p.n), static_cast<int>(k), 1};
  args.mainloop.ptr_A = static_cast<const Element*>(p.a);
  args.mainloop.dA = leading_stride<typename Kernel::StrideA>(p.lda);
  args.mainloop.ptr_B = static_cast<const Element*>(p.b);
  args.mainloop.dB = leading_stride<typename Kernel::StrideB>(p.ldb);
  args.mainloop.ptr_A2 = static_cast<const Element*>(p.a2);
  args.mainloop.dA2 = leading_stride<typename Kernel::StrideA>(p.lda2);
  args.mainloop.ptr_B2 = static_cast<const Element*>(p.b2);
  args.mainloop.dB2 = leading_stride<typename Kernel::StrideB>(p.ldb2);
  args.mainloop.k1 = static_cast<int>(p.k);
  args.mainloop.k2 = static_cast<int>(p.k2);
  auto& fusion = args.epilogue.thread;
  fusion.alpha = p.alpha;
  fusion.beta = p.beta;
  // No C: D stands in for it (a valid address for its TMA descriptor); beta 0, so the epilogue never loads it.
  args.epilogue.ptr_C = static_cast<const Element*>(p.c != nullptr ? p.c : p.d);
  args.epilogue.dC = dD;
  args.epilogue.ptr_D = static_cast<Element*>(p.d);
  args.epilogue.dD = dD;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = p.order.along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = p.order.swizzle;
  return args;
}

}  // namespace

// The dispatcher (grouped_gemm_sm90.cu) has checked p and that sm90_runs_plain(p).
extern const Sm90TileKernels kSm90DensePlain = {
    [](const GroupedGemmSm90Params& p, int device) {
      return static_cast<int64_t>(Gemm::get_workspace_size(arguments(p, device)));
    },
    [](const GroupedGemmSm90Params& p, void* workspace, int device, cudaStream_t stream) -> const char* {
      const std::string error = run_cutlass_gemm<Gemm>(arguments(p, device), workspace, stream);
      return error.empty() ? nullptr : sm90_failure("plain kernel: " + error);
    },
};

}  // namespace pykernels::gemm

#endif  // PYKERNELS_SM90A_GEMM
