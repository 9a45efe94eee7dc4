// The Hopper lm_head GEMMs of the fused token logprobs for one tile (what they compute:
// logprobs_sm90.h): each logprobs_tile_*_sm90.cu defines the tile's macros and includes this file
// once, defining that tile's LogprobsSm90TileKernels (logprobs_sm90_tiles.h); logprobs_sm90.cu
// dispatches. CUTLASS 3.x warp-specialized cooperative kernels (TMA loads, two consumer warpgroups
// issuing wgmma on one tile, fp32 accumulators, the epilogue after the mainloop) whose epilogues are
// visitor trees (EVT):
//   softmax partials  AccFetch -> Sm90SoftmaxPartials (softmax_partials_visitor_sm90.cuh), no D
//   logit grad        AccFetch, 4 per-row broadcasts -> LogitGrad -> bf16 D by TMA store
//
//   PYKERNELS_LOGPROBS_TILE_SHAPE    cute Shape<M, _128, K>: M tokens (dividing kSm90RowPad) by 128
//                                    vocabulary entries
//   PYKERNELS_LOGPROBS_CLUSTER_SHAPE cute Shape<M, 1, 1> of the thread-block cluster
//   PYKERNELS_LOGPROBS_TILE_KERNELS  the LogprobsSm90TileKernels this file defines
#pragma once

#ifndef PYKERNELS_LOGPROBS_TILE_KERNELS
#error "define the tile's macros before including logprobs_sm90_kernels.cuh"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cutlass_sm90.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "logprobs/logit_grad.h"
#include "logprobs/logprobs_sm90.h"
#include "logprobs/logprobs_sm90_tiles.h"
#include "logprobs/softmax_partials_visitor_sm90.cuh"
#include "logprobs/vocab_chunks.h"

namespace pykernels::logprobs {
namespace {
using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

using Element = cutlass::bfloat16_t;
using TileShape = PYKERNELS_LOGPROBS_TILE_SHAPE;
using ClusterShape = PYKERNELS_LOGPROBS_CLUSTER_SHAPE;
using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
constexpr int kTileRows = size<0>(TileShape{});
static_assert(size<1>(TileShape{}) == kSm90Tile && kSm90RowPad % kTileRows == 0,
              "vocab_chunks.h's partial planes assume 128 vocabulary entries a tile and rows padded to kSm90RowPad");

// The visitor's planes are where the fold kernel reads them: (row 300 = tile 300 / kTileRows,
// N tile 7) of a 300 x 1000 problem, laid out as a problem of partial_rows(300) rows.
static_assert(sm90::partials_plane_layout(Shape<Int<kTileRows>, _128>{},
                                          make_shape(Int<partial_rows(300)>{}, Int<1000>{}, _1{}))(
                  make_coord(make_coord(300 % kTileRows, 300 / kTileRows), make_coord(5, 7), 0)) ==
                  partial_index(300, 7, partial_rows(300)),
              "softmax partial planes: CUTLASS's layout and vocab_chunks.h's partial_index disagree");

// dL/dz times 1/T for one logit, without the target's + g_lp (launch_fix_target_grads adds it).
struct LogitGradArguments {
  float scale = 1.0f;
};
template <class T>
struct LogitGrad {
  using Arguments = LogitGradArguments;  // one type for every T: Sm90Compute passes the float one's
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& lse, T const& shift, T const& g_lp, T const& g_ent,
                                   Arguments const& args) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kElements; ++i) {
      out[i] = args.scale * logit_grad(args.scale * acc[i], lse[i], shift[i], g_lp[i], g_ent[i], false);
    }
    return out;
  }
};

using RowVector = fusion::Sm90ColBroadcast<0, TileShape, float>;  // one fp32 value per GEMM row (token)
using LogitGradTree = fusion::Sm90EVT<
    fusion::Sm90Compute<LogitGrad, Element, float, cutlass::FloatRoundStyle::round_to_nearest>, fusion::Sm90AccFetch,
    RowVector, RowVector, RowVector, RowVector>;
using PartialsTree = fusion::Sm90EVT<sm90::Sm90SoftmaxPartials<TileShape>, fusion::Sm90AccFetch>;

// Spelled out at namespace scope (g++ 12 cannot parse CUTLASS's epilogue builder in a dependent
// context, common/grouped_gemm_sm90_kernels.cuh).
using PartialsEpilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 4, void,
    cutlass::layout::RowMajor, 4, EpilogueSchedule, PartialsTree>::CollectiveOp;
using LogitGradEpilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::RowMajor, 8, EpilogueSchedule, LogitGradTree>::CollectiveOp;

// z = h W^T: h row-major [tokens, H], W [rows, H] is B in K-major (column-major) form.
template <class EpilogueT>
struct LogitsGemm {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueT::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, EpilogueT>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;
};
using PartialsGemm = LogitsGemm<PartialsEpilogue>;
using LogitGradGemm = LogitsGemm<LogitGradEpilogue>;

template <class G>
typename G::Gemm::Arguments base_arguments(const LogitsGemmSm90& g, int device) {
  const int k = static_cast<int>(g.h);
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(g.tokens), static_cast<int>(g.rows), k, 1};
  args.mainloop.ptr_A = static_cast<const Element*>(g.hidden);
  args.mainloop.dA = gemm::leading_stride<typename G::StrideA>(k);
  args.mainloop.ptr_B = static_cast<const Element*>(g.weight);
  args.mainloop.dB = gemm::leading_stride<typename G::StrideB>(k);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return args;
}

typename PartialsGemm::Gemm::Arguments arguments(const SoftmaxPartialsSm90Params& p, int device) {
  auto args = base_arguments<PartialsGemm>(p.gemm, device);
  args.epilogue.thread.op_1 = {p.max_z, p.sum_exp, p.sum_exp_z, p.gemm.scale, p.slack};  // op_0: AccFetch
  return args;
}

typename LogitGradGemm::Gemm::Arguments arguments(const LogitGradSm90Params& p, int device) {
  auto args = base_arguments<LogitGradGemm>(p.gemm, device);
  auto& tree = args.epilogue.thread;  // {AccFetch, lse, shift, g_lp, g_ent, LogitGrad}
  get<1>(tree) = {p.lse};
  get<2>(tree) = {p.shift};
  get<3>(tree) = {p.grad_logprob};
  get<4>(tree) = {p.grad_entropy};
  get<5>(tree) = LogitGradArguments{p.gemm.scale};
  args.epilogue.ptr_D = static_cast<Element*>(p.dz);
  args.epilogue.dD = gemm::leading_stride<typename LogitGradGemm::StrideD>(p.ld);
  return args;
}

template <class G, class P>
int64_t workspace_bytes(const P& p, int device) {
  return int64_t(G::Gemm::get_workspace_size(arguments(p, device)));
}

template <class G, class P>
const char* run(const P& p, void* workspace, int device, cudaStream_t stream) {
  const std::string error = gemm::run_cutlass_gemm<typename G::Gemm>(arguments(p, device), workspace, stream);
  return error.empty() ? nullptr : logprobs_sm90_failure(error);
}

}  // namespace

// This tile's entry points for the dispatcher (logprobs_sm90.cu), which has checked the parameters.
extern const LogprobsSm90TileKernels PYKERNELS_LOGPROBS_TILE_KERNELS = {
    [](const SoftmaxPartialsSm90Params& p, int device) { return workspace_bytes<PartialsGemm>(p, device); },
    [](const LogitGradSm90Params& p, int device) { return workspace_bytes<LogitGradGemm>(p, device); },
    [](const SoftmaxPartialsSm90Params& p, void* workspace, int device, cudaStream_t stream) {
      return run<PartialsGemm>(p, workspace, device, stream);
    },
    [](const LogitGradSm90Params& p, void* workspace, int device, cudaStream_t stream) {
      return run<LogitGradGemm>(p, workspace, device, stream);
    },
};

}  // namespace pykernels::logprobs
