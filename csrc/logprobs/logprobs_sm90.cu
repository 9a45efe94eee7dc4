// The Hopper lm_head GEMMs of the fused token logprobs (what they compute: logprobs_sm90.h). CUTLASS
// 3.x warp-specialized cooperative kernels (TMA loads, two consumer warpgroups issuing wgmma on
// 128x128x64 tiles, fp32 accumulators) whose epilogues are visitor trees (EVT):
//   softmax partials  AccFetch -> Sm90SoftmaxPartials (softmax_partials_visitor_sm90.cuh), no D
//   logit grad        AccFetch, 4 per-row broadcasts -> LogitGrad -> bf16 D by TMA store
// Compiled for sm_90a alone (cmake/sm90_sources.cmake); elsewhere the launchers say "not built".
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "logprobs/logit_grad.h"
#include "logprobs/logprobs_sm90.h"
#include "logprobs/vocab_chunks.h"

#ifdef PYKERNELS_SM90A_GEMM
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "common/cutlass_sm90.cuh"
#include "logprobs/softmax_partials_visitor_sm90.cuh"
#endif

namespace pykernels::logprobs {
namespace {

const char* fail(std::string message) {
  thread_local std::string last;
  last = "token_logprobs (sm_90a): " + std::move(message);
  return last.c_str();
}

}  // namespace

#ifdef PYKERNELS_SM90A_GEMM
namespace {
using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;
static_assert(size<0>(TileShape{}) == kSm90Tile && size<1>(TileShape{}) == kSm90Tile,
              "vocab_chunks.h's partial planes assume these tiles");

// The visitor's planes are where the fold kernel reads them: (row 300 = tile 2 row 44, N tile 7)
// of a 300 x 1000 problem.
static_assert(sm90::partials_plane_layout(Shape<_128, _128>{}, make_shape(Int<300>{}, Int<1000>{}, _1{}))(
                  make_coord(make_coord(44, 2), make_coord(5, 7), 0)) == partial_index(2 * 128 + 44, 7, partial_rows(300)),
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
// context, common/grouped_gemm_sm90.cu).
using PartialsEpilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 4, void,
    cutlass::layout::RowMajor, 4, cutlass::epilogue::TmaWarpSpecializedCooperative, PartialsTree>::CollectiveOp;
using LogitGradEpilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, 8, Element,
    cutlass::layout::RowMajor, 8, cutlass::epilogue::TmaWarpSpecializedCooperative, LogitGradTree>::CollectiveOp;

// z = h W^T: h row-major [tokens, H], W [rows, H] is B in K-major (column-major) form.
template <class EpilogueT>
struct LogitsGemm {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueT::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
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
  args.epilogue.thread.op_1 = {p.max_z, p.sum_exp, p.sum_exp_z, p.gemm.scale};  // op_0: AccFetch
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
  return error.empty() ? nullptr : fail(error);
}

}  // namespace
#endif  // PYKERNELS_SM90A_GEMM

bool logprobs_sm90_built() {
#ifdef PYKERNELS_SM90A_GEMM
  return true;
#else
  return false;
#endif
}

int64_t softmax_partials_sm90_workspace_bytes(const SoftmaxPartialsSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return workspace_bytes<PartialsGemm>(p, device);
#else
  (void)p, (void)device;
  return 0;
#endif
}

int64_t logit_grad_sm90_workspace_bytes(const LogitGradSm90Params& p, int device) {
#ifdef PYKERNELS_SM90A_GEMM
  return workspace_bytes<LogitGradGemm>(p, device);
#else
  (void)p, (void)device;
  return 0;
#endif
}

const char* launch_softmax_partials_sm90(const SoftmaxPartialsSm90Params& p, void* workspace, int device,
                                         cudaStream_t stream) {
#ifdef PYKERNELS_SM90A_GEMM
  if (const char* error = logits_gemm_sm90_error(p.gemm)) return fail(error);
  return run<PartialsGemm>(p, workspace, device, stream);
#else
  (void)p, (void)workspace, (void)device, (void)stream;
  return fail("not built (the extension's CUDA archs do not include 90a)");
#endif
}

const char* launch_logit_grad_sm90(const LogitGradSm90Params& p, void* workspace, int device, cudaStream_t stream) {
#ifdef PYKERNELS_SM90A_GEMM
  if (const char* error = logit_grad_sm90_error(p)) return fail(error);
  return run<LogitGradGemm>(p, workspace, device, stream);
#else
  (void)p, (void)workspace, (void)device, (void)stream;
  return fail("not built (the extension's CUDA archs do not include 90a)");
#endif
}

}  // namespace pykernels::logprobs
