// What a CUTLASS sm90 epilogue visitor node that only consumes the accumulators needs besides its own
// visit: no shared memory, no workspace, nothing loaded by the producer warp, no C, and its Params
// the same as its Arguments. The logprobs
// statistics node (logprobs/softmax_partials_visitor_sm90.cuh) and the gated activation's
// (moe/gated_act_visitor_sm90.cuh) derive from it.
#pragma once

#include <cstddef>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace pykernels::gemm {

struct Sm90StoreNode {
  struct SharedStorage {};

  template <class ProblemShape, class Arguments>
  static constexpr Arguments to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

}  // namespace pykernels::gemm
