// The Hopper GEMM core's kernels for one tile configuration (the math in grouped_gemm_sm90.h): each
// common/grouped_gemm_tile_*_sm90.cu defines the configuration's macros and includes this file once,
// defining that tile's Sm90TileKernels (grouped_gemm_sm90_tiles.h); grouped_gemm_sm90.cu dispatches.
// One file per tile, so the GPU node's build compiles the tiles in parallel.
//
//   PYKERNELS_SM90_TILE_SHAPE         cute Shape<M, N, K> of a CTA's tile
//   PYKERNELS_SM90_CLUSTER_SHAPE      cute Shape<M, N, 1> of the thread-block cluster
//   PYKERNELS_SM90_KERNEL_SCHEDULE    cutlass::gemm::KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}
//   PYKERNELS_SM90_EPILOGUE_SCHEDULE  the matching cutlass::epilogue::PtrArrayTmaWarpSpecialized*
//   PYKERNELS_SM90_TILE_KERNELS       the Sm90TileKernels this file defines
//
// Macros rather than a class template over the configuration: g++ 12 fails to parse CUTLASS's
// epilogue builder in a dependent context (through nvcc's host pass).
//
// problems  One thread per group writes the group's (M, N, K), operand pointers and strides into
//           the workspace from expert_offsets on the device (gemm_groups.h, tested on the host);
//           CUTLASS gets no host copy of the shapes, so nothing waits on the host. Its persistent
//           tile scheduler walks the groups' tiles.
// kernel    TMA loads into a multi-stage shared-memory pipeline (a producer warp), consumer
//           warpgroups issuing wgmma with fp32 accumulators (cooperative: two on one tile; ping-pong:
//           one per tile, alternating), TMA stores in the epilogue (D = alpha acc + beta C). TMA
//           zero-fills the M, N and K tails of a group, so any size works.
// scope     bf16 operands, bf16 or fp32 D: six kernels, three operand layouts x two output types;
//           and two with extra K (kRowsKMajorB, kRowsNMajorB, bf16 D: the MoE experts' LoRA in the
//           base GEMM), whose mainloop reads a second operand pair (extended_k_array_mainloop_sm90.cuh);
//           and the gated gate_up GEMM (kRowsKMajorB, bf16 D, act_out: paired_rows.h), the same
//           mainloop reading B paired, with or without the second pair, whose epilogue also writes
//           act(gate) * up (moe/gated_act_visitor_sm90.cuh); and both of the gated GEMM and the
//           kRowsNMajorB extra-K GEMM again with A's rows gathered by the producer warp (a_rows).
#pragma once

#ifndef PYKERNELS_SM90_TILE_KERNELS
#error "define the tile configuration's macros before including grouped_gemm_sm90_kernels.cuh"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cutlass_sm90.cuh"
#include "common/extended_k_array_mainloop_sm90.cuh"
#include "common/gemm_groups.h"
#include "common/grouped_gemm_sm90.h"
#include "common/grouped_gemm_sm90_tiles.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "moe/gated_act_visitor_sm90.cuh"

namespace pykernels::gemm {
namespace {
using namespace cute;

using ElementAB = cutlass::bfloat16_t;
using TileShape = PYKERNELS_SM90_TILE_SHAPE;
using ClusterShape = PYKERNELS_SM90_CLUSTER_SHAPE;

// The epilogues, D = alpha acc + beta C with 16-byte TMA stores, for bf16 and fp32 D (and C),
// spelled out (not an alias template: see the top of this file).
using EpilogueBf16 = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, cutlass::bfloat16_t, cutlass::layout::RowMajor*, 8,
    cutlass::bfloat16_t, cutlass::layout::RowMajor*, 8, PYKERNELS_SM90_EPILOGUE_SCHEDULE,
    cutlass::epilogue::fusion::LinearCombination<cutlass::bfloat16_t, float>>::CollectiveOp;
using EpilogueFp32 = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, cutlass::layout::RowMajor*, 4, float,
    cutlass::layout::RowMajor*, 4, PYKERNELS_SM90_EPILOGUE_SCHEDULE,
    cutlass::epilogue::fusion::LinearCombination<float, float>>::CollectiveOp;
// The gated GEMM's: D = acc (bf16, no C) and act(gate) * up per column pair into act_out.
using GatedActTree = cutlass::epilogue::fusion::Sm90EVT<moe::sm90::Sm90GatedActStore<cutlass::bfloat16_t>,
                                                        cutlass::epilogue::fusion::Sm90AccFetch>;
using EpilogueGated = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor*, 8,
    cutlass::bfloat16_t, cutlass::layout::RowMajor*, 8, PYKERNELS_SM90_EPILOGUE_SCHEDULE, GatedActTree>::CollectiveOp;

// One CUTLASS grouped GEMM: bf16 A and B in the given layouts, row-major D by Epilogue; with
// kExtended, the extra-K mainloop over a second operand pair (its two more TMA descriptors carved
// out of shared memory before the stages are counted); with kGatedB, that mainloop reading B paired
// (EpilogueGated's GEMM); with kGatherA, that mainloop gathering A's rows (p.a_rows).
template <class LayoutA, class LayoutB, class EpilogueT, bool kExtended = false, bool kGatedB = false,
          bool kGatherA = false>
struct GroupedGemm {
  static_assert((!kGatedB && !kGatherA) || kExtended,
                "the gated GEMM and a gathered A run on the extra-K mainloop");
  using Element = ElementAB;
  using Epilogue = EpilogueT;
  using ElementD = typename Epilogue::ElementD;
  static constexpr bool kExtraK = kExtended;
  static constexpr bool kGated = kGatedB;
  static constexpr bool kGather = kGatherA;
  static constexpr int kCarveout = static_cast<int>(sizeof(typename EpilogueT::SharedStorage)) +
                                   (kExtended ? 2 * static_cast<int>(sizeof(cute::TmaDescriptor)) : 0);
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, 8, Element, LayoutB*, 8, float,
      TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<kCarveout>,
      PYKERNELS_SM90_KERNEL_SCHEDULE>::CollectiveOp;
  using Mainloop =
      cute::conditional_t<kExtended, ExtendedKArrayMainloop<BaseMainloop, kGatedB, kGatherA>, BaseMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
};

using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

// The per-group arrays CUTLASS reads, carved from the front of the workspace.
template <class G>
struct GroupArrays {
  typename G::Shape3* shapes;
  const typename G::Element** a;
  const typename G::Element** b;
  const typename G::ElementD** c;
  typename G::ElementD** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  const typename G::Element** a2;  // extra K (G::kExtraK only)
  const typename G::Element** b2;
  typename G::StrideA* stride_a2;
  typename G::StrideB* stride_b2;
  void* cutlass_workspace;
};

constexpr int64_t kWorkspaceAlignment = 256;
int64_t aligned(int64_t bytes) { return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment; }

template <class G>
GroupArrays<G> carve(void* workspace, int64_t groups, int64_t* bytes_used = nullptr) {
  char* at = static_cast<char*>(workspace);
  int64_t used = 0;
  auto take = [&](int64_t bytes) {
    void* p = at == nullptr ? nullptr : at + used;
    used += aligned(bytes);
    return p;
  };
  GroupArrays<G> arrays{};
  arrays.shapes = static_cast<typename G::Shape3*>(take(groups * sizeof(typename G::Shape3)));
  arrays.a = static_cast<const typename G::Element**>(take(groups * sizeof(void*)));
  arrays.b = static_cast<const typename G::Element**>(take(groups * sizeof(void*)));
  arrays.c = static_cast<const typename G::ElementD**>(take(groups * sizeof(void*)));
  arrays.d = static_cast<typename G::ElementD**>(take(groups * sizeof(void*)));
  arrays.stride_a = static_cast<typename G::StrideA*>(take(groups * sizeof(typename G::StrideA)));
  arrays.stride_b = static_cast<typename G::StrideB*>(take(groups * sizeof(typename G::StrideB)));
  arrays.stride_d = static_cast<typename G::StrideD*>(take(groups * sizeof(typename G::StrideD)));
  if constexpr (G::kExtraK) {
    arrays.a2 = static_cast<const typename G::Element**>(take(groups * sizeof(void*)));
    arrays.b2 = static_cast<const typename G::Element**>(take(groups * sizeof(void*)));
    arrays.stride_a2 = static_cast<typename G::StrideA*>(take(groups * sizeof(typename G::StrideA)));
    arrays.stride_b2 = static_cast<typename G::StrideB*>(take(groups * sizeof(typename G::StrideB)));
  }
  arrays.cutlass_workspace = at == nullptr ? nullptr : at + used;
  if (bytes_used != nullptr) *bytes_used = used;
  return arrays;
}

constexpr int kSetupThreads = 128;

// Thread e writes group e.
template <class G>
__global__ void __launch_bounds__(kSetupThreads) group_setup_kernel(const GroupedGemmSm90Params p, GroupArrays<G> out) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= p.experts) return;
  const GroupProblem g =
      p.kind == Sm90GemmKind::kWeightGrad
          ? weight_grad_group(p.expert_offsets, p.experts, p.slots, e, p.m, p.n, p.lda, p.ldb, p.d_expert_stride)
          : rows_group(p.expert_offsets, p.experts, p.slots, e, p.n, p.k, p.lda, p.b_expert_stride, p.ldd);
  using Element = typename G::Element;
  using ElementD = typename G::ElementD;
  const Element* zeros = static_cast<const Element*>(p.zeros);
  int64_t k = g.k;
  if constexpr (G::kExtraK) {  // both pairs in whole k tiles (extended_k_array_mainloop_sm90.cuh)
    const ExtraKGroup x = extra_k_group(p.expert_offsets, p.experts, p.slots, e, g.k, p.k2, p.lda2,
                                        p.b2_expert_stride, size<2>(TileShape{}));
    k = x.k;
    out.a2[e] = static_cast<const Element*>(p.a2) + x.a2_offset;
    out.b2[e] = static_cast<const Element*>(p.b2) + x.b2_offset;
    out.stride_a2[e] = leading_stride<typename G::StrideA>(p.lda2);
    out.stride_b2[e] = leading_stride<typename G::StrideB>(p.ldb2);
  }
  out.shapes[e] = typename G::Shape3(static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(k));
  out.a[e] = g.zeros ? zeros : static_cast<const Element*>(p.a) + g.a_offset;
  out.b[e] = g.zeros ? zeros : static_cast<const Element*>(p.b) + g.b_offset;
  out.d[e] = static_cast<ElementD*>(p.d) + g.d_offset;
  out.c[e] = p.c != nullptr ? static_cast<const ElementD*>(p.c) + g.d_offset : nullptr;
  out.stride_a[e] = leading_stride<typename G::StrideA>(p.lda);
  out.stride_b[e] = leading_stride<typename G::StrideB>(p.ldb);
  out.stride_d[e] = leading_stride<typename G::StrideD>(p.ldd);
}

template <class G>
typename G::Gemm::Arguments arguments(const GroupedGemmSm90Params& p, const GroupArrays<G>& arrays, int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(p.experts), arrays.shapes, nullptr};  // shapes on the device only
  args.mainloop.ptr_A = arrays.a;
  args.mainloop.dA = arrays.stride_a;
  args.mainloop.ptr_B = arrays.b;
  args.mainloop.dB = arrays.stride_b;
  if constexpr (G::kExtraK) {
    args.mainloop.ptr_A2 = arrays.a2;
    args.mainloop.dA2 = arrays.stride_a2;
    args.mainloop.ptr_B2 = arrays.b2;
    args.mainloop.dB2 = arrays.stride_b2;
    args.mainloop.k1 = static_cast<int>(p.k);
    args.mainloop.k2 = static_cast<int>(p.k2);
  }
  if constexpr (G::kGather) {
    args.mainloop.gather_rows = p.a_rows;
    args.mainloop.gather_a = static_cast<const typename G::Element*>(p.a);
    args.mainloop.gather_lda = p.lda;
    args.mainloop.gather_a2 = static_cast<const typename G::Element*>(p.a2);
    args.mainloop.gather_lda2 = p.lda2;
    args.mainloop.expert_offsets = p.expert_offsets;
    args.mainloop.experts = p.experts;
    args.mainloop.slots = p.slots;
  }
  if constexpr (G::kGated) {
    args.mainloop.paired_inner = p.n / 2;
    args.mainloop.paired_ldb = p.ldb;
    args.epilogue.thread.op_1 = {p.act_out, p.expert_offsets, p.experts, p.slots, p.n / 2, p.act_spec};
  } else {
    auto& fusion = args.epilogue.thread;
    fusion.alpha = p.alpha;
    fusion.beta = p.beta;
    args.epilogue.ptr_C = p.c != nullptr ? arrays.c : nullptr;  // no C: the epilogue loads no source
    args.epilogue.dC = arrays.stride_d;
  }
  args.epilogue.ptr_D = arrays.d;
  args.epilogue.dD = arrays.stride_d;
  args.hw_info = hw;
  using RasterOrder = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order = p.order.along_n ? RasterOrder::AlongN : RasterOrder::AlongM;
  args.scheduler.max_swizzle_size = p.order.swizzle;
  return args;
}

// The gated GEMM and a gathered A without extra K run their mainloop with an empty second pair (K2 =
// 0) whose descriptors, never loaded, point at the first pair.
GroupedGemmSm90Params with_empty_second_pair(const GroupedGemmSm90Params& p) {
  if ((p.act_out == nullptr && p.a_rows == nullptr) || p.a2 != nullptr) return p;
  GroupedGemmSm90Params q = p;
  q.a2 = p.a, q.lda2 = p.lda, q.b2 = p.b, q.ldb2 = p.ldb, q.b2_expert_stride = p.b_expert_stride, q.k2 = 0;
  return q;
}

template <class G>
int64_t workspace_bytes(const GroupedGemmSm90Params& params, int device) {
  const GroupedGemmSm90Params p = with_empty_second_pair(params);
  int64_t arrays_bytes = 0;
  const GroupArrays<G> arrays = carve<G>(nullptr, p.experts, &arrays_bytes);
  return arrays_bytes + aligned(int64_t(G::Gemm::get_workspace_size(arguments<G>(p, arrays, device))));
}

template <class G>
const char* run(const GroupedGemmSm90Params& params, void* workspace, int device, cudaStream_t stream) {
  const GroupedGemmSm90Params p = with_empty_second_pair(params);
  const GroupArrays<G> arrays = carve<G>(workspace, p.experts);
  const int blocks = static_cast<int>((p.experts + kSetupThreads - 1) / kSetupThreads);
  group_setup_kernel<G><<<blocks, kSetupThreads, 0, stream>>>(p, arrays);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess)
    return sm90_failure(std::string("group setup launch failed: ") + cudaGetErrorString(error));
  const std::string error =
      run_cutlass_gemm<typename G::Gemm>(arguments<G>(p, arrays, device), arrays.cutlass_workspace, stream);
  return error.empty() ? nullptr : sm90_failure(error);
}

template <class Epilogue, class F>
auto with_layouts(Sm90GemmKind kind, F&& f) {
  switch (kind) {
    case Sm90GemmKind::kRowsKMajorB: return f(GroupedGemm<RowMajor, ColumnMajor, Epilogue>{});
    case Sm90GemmKind::kRowsNMajorB: return f(GroupedGemm<RowMajor, RowMajor, Epilogue>{});
    default: return f(GroupedGemm<ColumnMajor, RowMajor, Epilogue>{});
  }
}

// f(GroupedGemm<...>{}) for the kernel of p's kind and output type (extra K: the two kinds it has,
// bf16 D; gated: kRowsKMajorB, bf16 D; gathered A: gated or kRowsNMajorB, bf16 D;
// grouped_gemm_sm90_error has checked that).
template <class F>
auto with_kernel(const GroupedGemmSm90Params& p, F&& f) {
  if (p.act_out != nullptr) {
    return p.a_rows != nullptr ? f(GroupedGemm<RowMajor, ColumnMajor, EpilogueGated, true, true, true>{})
                               : f(GroupedGemm<RowMajor, ColumnMajor, EpilogueGated, true, true>{});
  }
  if (p.a_rows != nullptr) return f(GroupedGemm<RowMajor, RowMajor, EpilogueBf16, true, false, true>{});
  if (p.a2 != nullptr) {
    return p.kind == Sm90GemmKind::kRowsKMajorB ? f(GroupedGemm<RowMajor, ColumnMajor, EpilogueBf16, true>{})
                                                : f(GroupedGemm<RowMajor, RowMajor, EpilogueBf16, true>{});
  }
  return p.d_dtype == DType::kFloat32 ? with_layouts<EpilogueFp32>(p.kind, f) : with_layouts<EpilogueBf16>(p.kind, f);
}

}  // namespace

// This configuration's entry points for the dispatcher (grouped_gemm_sm90.cu), which has checked p.
extern const Sm90TileKernels PYKERNELS_SM90_TILE_KERNELS = {
    [](const GroupedGemmSm90Params& p, int device) {
      return with_kernel(p, [&](auto g) { return workspace_bytes<decltype(g)>(p, device); });
    },
    [](const GroupedGemmSm90Params& p, void* workspace, int device, cudaStream_t stream) {
      return with_kernel(p, [&](auto g) { return run<decltype(g)>(p, workspace, device, stream); });
    },
};

}  // namespace pykernels::gemm
