// The plain (one problem, not ptr-array) twin of extended_k_array_mainloop_sm90.cuh: a CUTLASS 3.x sm90
// TMA warp-specialized mainloop whose K runs over two operand pairs, one after the other,
//
//   D = [A1 | A2] [B1 | B2]^T = A1 B1^T + A2 B2^T      A1 [M, K1], B1 [N, K1], A2 [M, K2], B2 [N, K2]
//
// into one set of accumulators: the dense LoRA forward (x W^T + U V^T, lora/lora_extended_k.h) on
// CUTLASS's KernelTmaWarpSpecializedCooperative, whose TMA descriptors are kernel parameters, where
// the ptr-array kernel keeps them per SM in global memory and rewrites them in shared memory before
// its first tile (PYKERNELS_SM90_DENSE, common/sm90_dense_plain.h: which of the two is faster is the
// GPU's to say).
//
// How: the CollectiveMma CUTLASS's builder picks (MainloopSm90TmaGmmaWarpSpecialized) is kept whole
// but for its producer: a second pair of TMA descriptors and a load loop taking k tiles
// [0, ceil(K1 / BLK_K)) from the first pair and the ceil(K2 / BLK_K) after them from the second. The
// kernel's problem K is the sum of both in whole tiles (the consumers loop over its k-tile count); the
// stages, barriers and transaction bytes are the first pair's (the same box shapes), and TMA
// zero-fills each pair's last k tile past K1 / K2. No shared memory is added (the descriptors are
// parameters), so the stage count is the base GEMM's.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace pykernels::gemm {

template <class Base>
struct ExtendedKMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::TileShape;
  using typename Base::DispatchPolicy;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  static constexpr int kBlockK = cute::size<2>(TileShape{});

  struct Arguments {
    ElementA const* ptr_A;  // the first pair: A1 [M, K1], B1 [N, K1]
    StrideA dA;
    ElementB const* ptr_B;
    StrideB dB;
    ElementA const* ptr_A2;  // the second: A2 [M, K2], B2 [N, K2]
    StrideA dA2;
    ElementB const* ptr_B2;
    StrideB dB2;
    int k1 = 0, k2 = 0;
  };

  struct Params : Base::Params {
    typename Base::Params::TMA_A tma_load_a2;
    typename Base::Params::TMA_B tma_load_b2;
    int k1_tiles;
  };

  static constexpr int tiles_of(int k) { return (k + kBlockK - 1) / kBlockK; }

  // problem_shape's K is tiles_of(K1) + tiles_of(K2) whole k tiles; each pair's descriptors get its own K.
  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    Params params{};
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        cute::make_shape(M, N, args.k1, L), typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB},
        workspace);
    const typename Base::Params second = Base::to_underlying_arguments(
        cute::make_shape(M, N, args.k2, L), typename Base::Arguments{args.ptr_A2, args.dA2, args.ptr_B2, args.dB2},
        workspace);
    params.tma_load_a2 = second.tma_load_a;
    params.tma_load_b2 = second.tma_load_b;
    params.k1_tiles = tiles_of(args.k1);
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = cute::append<4>(problem_shape, 1);
    return args.k1 >= 1 && args.k2 >= 1 && K == (tiles_of(args.k1) + tiles_of(args.k2)) * kBlockK &&
           Base::can_implement(cute::make_shape(M, N, args.k1, L),
                               typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB}) &&
           Base::can_implement(cute::make_shape(M, N, args.k2, L),
                               typename Base::Arguments{args.ptr_A2, args.dA2, args.ptr_B2, args.dB2});
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_a2.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b2.get_tma_descriptor());
  }

  // (gA1, gB1, gA2, gB2) tiled. The first pair's tensors span the problem's whole K, so the kernel's k-tile
  // iterator (built on gA1's k extent) counts both pairs' tiles; its descriptors stop at K1.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = cute::Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    const int k2 = K - params.k1_tiles * kBlockK;
    auto tiled = [](auto full, auto step) {
      return cute::local_tile(full, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_), step);
    };
    return cute::make_tuple(
        tiled(params.tma_load_a.get_tma_tensor(cute::make_shape(M, K, L)), cute::Step<cute::_1, X, cute::_1>{}),
        tiled(params.tma_load_b.get_tma_tensor(cute::make_shape(N, K, L)), cute::Step<X, cute::_1, cute::_1>{}),
        tiled(params.tma_load_a2.get_tma_tensor(cute::make_shape(M, k2, L)), cute::Step<cute::_1, X, cute::_1>{}),
        tiled(params.tma_load_b2.get_tma_tensor(cute::make_shape(N, k2, L)), cute::Step<X, cute::_1, cute::_1>{}));
  }

  // Base::load's loop, each k tile from the pair it lies in.
  template <class TensorA, class TensorB, class TensorA2, class TensorB2, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorA2, TensorB2> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t cluster_shape_x = get<0>(typename DispatchPolicy::ClusterShape());
    const uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x,
                                          block_rank_in_cluster / cluster_shape_x};
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto block_tma_a = params.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_local_block_id.x);
    auto block_tma_a2 = params.tma_load_a2.get_slice(cluster_local_block_id.y);
    auto block_tma_b2 = params.tma_load_b2.get_slice(cluster_local_block_id.x);
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tAgA2 = block_tma_a2.partition_S(get<2>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tBgB2 = block_tma_b2.partition_S(get<3>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBsB = block_tma_b.partition_D(sB);

    uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
    auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};  // (m, n) -> block id
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
    }
    if constexpr (is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k_tile = *k_tile_iter;
      if (k_tile < params.k1_tiles) {
        copy(params.tma_load_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, k_tile), tAsA(_, _, _, stage));
        copy(params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, k_tile), tBsB(_, _, _, stage));
      } else {
        const int k2_tile = k_tile - params.k1_tiles;
        copy(params.tma_load_a2.with(*tma_barrier, mcast_mask_a), tAgA2(_, _, _, k2_tile), tAsA(_, _, _, stage));
        copy(params.tma_load_b2.with(*tma_barrier, mcast_mask_b), tBgB2(_, _, _, k2_tile), tBsB(_, _, _, stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace pykernels::gemm
