// A CUTLASS 3.x sm90 grouped mainloop whose K runs over two operand pairs, one after the other, per
// group (expert):
//
//   D_e = [A1_e | A2_e] [B1_e | B2_e]^T = A1_e B1_e^T + A2_e B2_e^T
//         A1_e [M_e, K1], B1_e [N, K1], A2_e [M_e, K2], B2_e [N, K2]
//
// into one set of accumulators, with no concatenated copy of either side in memory: the MoE
// experts' LoRA (x W_e^T + u B_e^T, dy W_e + v A_e) and the dense LoRA forward (one group: x W^T
// + U V^T with the LoRA term and bias as extra K, lora/lora_extended_k.h) each in one GEMM of the
// Hopper core (common/grouped_gemm_sm90.h).
//
// How: the CollectiveMma CUTLASS's builder picks for the ptr-array TMA warp-specialized kernels
// (the producer warp loads k tiles into a shared-memory pipeline, the consumer warpgroups issue
// wgmma on whatever stage is full) is kept whole, and only its producer side is extended: a second
// pair of TMA descriptors, and a load loop that takes k tiles [0, ceil(K1 / BLK_K)) from the first
// pair and the ceil(K2 / BLK_K) after them from the second. The kernel sees each problem's K as the
// sum of both in whole tiles, so its k-tile count (which the consumers loop over) covers both; the
// stages, barriers and transaction bytes are the first pair's (the same box shapes), and TMA
// zero-fills each pair's last k tile past K1 / K2.
//
// kPairedB (the gated gate_up GEMM, common/paired_rows.h): B1 is read through a 3-D descriptor built
// here, (k, half, j) of each expert's [gate | up] weight, so the B tile's rows come in (gate_j, up_j)
// pairs; its box, loads and shared-memory rows are paired_rows.h's, everything else is unchanged (the
// same bytes per stage). The second pair may then be absent (K2 = 0: no LoRA term).
//
// kGatherA (the MoE rows GEMMs reading x or dy by token: PYKERNELS_SM90_MOE_GATHER, moe/moe.h): A1's
// row of slot s is gather_a[gather_rows[s]] and A2's is gather_a2[s]; no TMA can gather on Hopper, so the whole
// producer warp copies A's k tiles with 16-byte cp.async into the swizzled stage (4 rows a lane at a
// 128-row tile, 8 chunks a row), zero-filling rows past the group's and columns past K, while its
// leader lane loads B by TMA as before. The stage's full barrier then counts both: each lane's
// cp.async.mbarrier.arrive (issued before the leader's arrive, so the phase waits for them) and
// B's transaction bytes (the pipeline's, set to B's alone). No copy of the rows in slot order exists.
#pragma once

#include <cuda.h>

#include "common/gemm_groups.h"
#include "common/paired_rows.h"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace pykernels::gemm {

// The group (expert) a producer's tiles belong to, for the gathered A: its first slot and rows.
struct GatherGroup {
  int64_t first_slot = 0;
  int32_t rows = 0;
};

// Base: MainloopSm90ArrayTmaGmmaWarpSpecialized's CollectiveMma. Every group has its own A, B, A2,
// B2 pointers and strides. That mainloop keeps the TMA descriptors of A and B per SM in global
// memory and rewrites them in shared memory when a CTA moves to another group (address, dims,
// strides); here the same is done for four descriptors, so every method that touches them is the
// Base's with the second pair added. Base must be built with 2 more descriptors (256 bytes) of
// shared memory carved out of its stages. K1 and K2 are the pairs' extents (the same for all
// groups); the problem shapes' K is ceil(K1 / BLK_K) BLK_K + ceil(K2 / BLK_K) BLK_K, TMA
// zero-filling both pairs' last k tile.
template <class Base, bool kPairedB = false, bool kGatherA = false>
struct ExtendedKArrayMainloop : Base {
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::InternalElementA;
  using typename Base::InternalElementB;
  using typename Base::TileShape;
  using typename Base::DispatchPolicy;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::TMA_A;
  using typename Base::TMA_B;
  static constexpr int kBlockK = cute::size<2>(TileShape{});
  static constexpr int kBlockN = cute::size<1>(TileShape{});
  static constexpr int kBlockM = cute::size<0>(TileShape{});
  static constexpr int kClusterM = cute::size<0>(typename DispatchPolicy::ClusterShape{});
  static constexpr int kTensorMaps = 4;  // A, B, A2, B2 per SM in the workspace, in that order

  struct TensorMapStorage : cute::aligned_struct<128, cute::_0> {
    cute::TmaDescriptor smem_tensormap_A;
    cute::TmaDescriptor smem_tensormap_B;
    cute::TmaDescriptor smem_tensormap_A2;
    cute::TmaDescriptor smem_tensormap_B2;
  };

  struct Arguments {
    ElementA const** ptr_A;  // per group, the first pair: A1 [M, K1], B1 [N, K1]
    StrideA dA;
    ElementB const** ptr_B;
    StrideB dB;
    ElementA const** ptr_A2 = nullptr;  // the second: A2 [M, K2], B2 [N, K2]
    StrideA dA2 = nullptr;
    ElementB const** ptr_B2 = nullptr;
    StrideB dB2 = nullptr;
    int k1 = 0, k2 = 0;
    int64_t paired_inner = 0, paired_ldb = 0;  // kPairedB: I (B1_e is [2I, K1]) and B1_e's row stride
    // kGatherA: A1 row of slot s = gather_a + gather_rows[s] * gather_lda (null gather_rows: row s);
    // A2 row of slot s = gather_a2 + s * gather_lda2; the groups' slots from expert_offsets.
    const int64_t* gather_rows = nullptr;
    ElementA const* gather_a = nullptr;
    int64_t gather_lda = 0;
    ElementA const* gather_a2 = nullptr;
    int64_t gather_lda2 = 0;
    const int64_t* expert_offsets = nullptr;
    int64_t experts = 1, slots = 0;
  };

  struct Params : Base::Params {
    TMA_A tma_load_a2;
    TMA_B tma_load_b2;
    InternalElementA const** ptr_A2;
    StrideA dA2;
    InternalElementB const** ptr_B2;
    StrideB dB2;
    int k1, k2;
    cute::TmaDescriptor paired_b;  // kPairedB: B1's (k, half, j) descriptor, every group's but its address
    const int64_t* gather_rows;    // kGatherA: as in Arguments
    InternalElementA const* gather_a;
    int64_t gather_lda;
    InternalElementA const* gather_a2;
    int64_t gather_lda2;
    const int64_t* expert_offsets;
    int64_t experts, slots;
  };

  // B1's paired descriptor (paired_rows.h) at `address` (any 16-byte aligned one: each group sets its
  // own); false if the driver refuses it (the launcher has checked paired_rows_error before).
  static bool encode_paired_b(cute::TmaDescriptor* descriptor, void const* address, int64_t inner, int64_t k,
                              int64_t ldb) {
    static_assert(cute::sizeof_bits_v<InternalElementB> == 16, "the paired descriptor is for bf16 B");
    const PairedRowsBox b = paired_rows_box(inner, k, ldb, 2, kBlockN, kBlockK, kClusterM);
    const cuuint32_t element_strides[3] = {1, 1, 1};
    const cuuint32_t box[3] = {b.box[0], b.box[1], b.box[2]};
    const cuuint64_t dims[3] = {b.dims[0], b.dims[1], b.dims[2]};
    const cuuint64_t strides[2] = {b.strides[0], b.strides[1]};
    const CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        descriptor, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(address), dims, strides, box,
        element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return result == CUDA_SUCCESS;
  }

  static constexpr int k1_tiles_of(int k1) { return (k1 + kBlockK - 1) / kBlockK; }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params params{};
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(
        problem_shapes, typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB}, workspace);
    // The second pair's descriptors are placeholders like the Base's: every group rewrites them.
    const typename Base::Params second = Base::to_underlying_arguments(
        problem_shapes, typename Base::Arguments{args.ptr_A2, args.dA2, args.ptr_B2, args.dB2}, workspace);
    params.tma_load_a2 = second.tma_load_a;
    params.tma_load_b2 = second.tma_load_b;
    params.ptr_A2 = reinterpret_cast<InternalElementA const**>(args.ptr_A2);
    params.dA2 = args.dA2;
    params.ptr_B2 = reinterpret_cast<InternalElementB const**>(args.ptr_B2);
    params.dB2 = args.dB2;
    params.k1 = args.k1;
    params.k2 = args.k2;
    params.gather_rows = args.gather_rows;
    params.gather_a = reinterpret_cast<InternalElementA const*>(args.gather_a);
    params.gather_lda = args.gather_lda;
    params.gather_a2 = reinterpret_cast<InternalElementA const*>(args.gather_a2);
    params.gather_lda2 = args.gather_lda2;
    params.expert_offsets = args.expert_offsets;
    params.experts = args.experts;
    params.slots = args.slots;
    if constexpr (kGatherA) {  // A arrives by cp.async: the stage's transaction bytes are B's alone
      params.tma_transaction_bytes = static_cast<uint32_t>(kBlockN * kBlockK * sizeof(InternalElementB));
    }
    if constexpr (kPairedB) {
      const void* placeholder = reinterpret_cast<void const*>(reinterpret_cast<uint64_t>(args.ptr_B) & ~uint64_t{15});
      if (!encode_paired_b(&params.paired_b, placeholder, args.paired_inner, args.k1, args.paired_ldb))
        params.paired_b = cute::TmaDescriptor{};  // can_implement has refused these arguments
    }
    return params;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int sm_count) {
    return kTensorMaps * sizeof(cute::TmaDescriptor) * sm_count;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;  // the descriptors are written by each CTA (tensormaps_init)
  }

  // The shapes live on the device (nothing to check on the host but the pointers, K1 and K2).
  template <class ProblemShape>
  static bool can_implement(ProblemShape problem_shapes, Arguments const& args) {
    if constexpr (kPairedB) {
      cute::TmaDescriptor probe{};
      if (paired_rows_error(2 * args.paired_inner, args.k1, args.paired_ldb, 2, kBlockN, kBlockK, kClusterM) !=
              nullptr ||
          !encode_paired_b(&probe, args.ptr_B, args.paired_inner, args.k1, args.paired_ldb))
        return false;
    }
    if constexpr (kGatherA) {
      if (args.gather_a == nullptr || args.gather_lda % 8 != 0 || (args.k2 > 0 && args.gather_a2 == nullptr) ||
          args.gather_lda2 % 8 != 0 || args.k1 % 8 != 0 || args.k2 % 8 != 0)
        return false;
    }
    return args.k1 >= 1 && args.k2 >= (kPairedB || kGatherA ? 0 : 1) && args.ptr_A2 != nullptr &&
           args.ptr_B2 != nullptr && args.dA2 != nullptr && args.dB2 != nullptr &&
           Base::can_implement(problem_shapes, typename Base::Arguments{args.ptr_A, args.dA, args.ptr_B, args.dB});
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = cute::Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    auto tiled = [](auto full, auto step) {
      return cute::local_tile(full, TileShape{}, cute::make_coord(cute::_, cute::_, cute::_), step);
    };
    const int32_t init_l = 1;
    return cute::make_tuple(
        tiled(params.tma_load_a.get_tma_tensor(cute::make_shape(M, K, init_l)), cute::Step<cute::_1, X, cute::_1>{}),
        tiled(params.tma_load_b.get_tma_tensor(cute::make_shape(N, K, init_l)), cute::Step<X, cute::_1, cute::_1>{}),
        tiled(params.tma_load_a2.get_tma_tensor(cute::make_shape(M, cute::max(params.k2, 1), init_l)),
              cute::Step<cute::_1, X, cute::_1>{}),
        tiled(params.tma_load_b2.get_tma_tensor(cute::make_shape(N, cute::max(params.k2, 1), init_l)),
              cute::Step<X, cute::_1, cute::_1>{}),
        GatherGroup{});
  }

  // The kernel calls this when its producer moves to another group: the gathered A's group.
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& input_tensors, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
    InputTensors updated = input_tensors;
    if constexpr (kGatherA) {
      cute::get<4>(updated) = GatherGroup{
          group_slots(params.expert_offsets, params.experts, params.slots, next_batch).begin,
          static_cast<int32_t>(cute::get<0>(problem_shape_mnkl))};
    }
    return updated;
  }

  // This CTA's (x, y) in its cluster, and the CTAs B's multicast reaches (those sharing its y).
  CUTLASS_DEVICE static uint2 cluster_block_id(uint32_t block_rank_in_cluster) {
    constexpr uint32_t cluster_shape_x = cute::get<0>(typename DispatchPolicy::ClusterShape());
    return {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
  }
  CUTLASS_DEVICE static uint16_t mcast_mask_b_of(uint2 cluster_local_block_id) {
    uint16_t mask = 0;
    if constexpr (cute::is_same_v<GmemTiledCopyB, cute::SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = cute::Layout<typename DispatchPolicy::ClusterShape>{};
      for (int m = 0; m < cute::size<0>(block_layout); ++m)
        mask |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, cute::Int<0>{}));
    }
    return mask;
  }

  // (tBgB, tBgB2, tBsB) for load_b_tile: this CTA's slices of B's and B2's n tile, and the stages they fill.
  template <class LoadInputs, class NCoord, class LCoord>
  CUTLASS_DEVICE static auto partition_b(Params const& params, LoadInputs const& load_inputs, NCoord n_coord,
                                         LCoord l_coord, uint32_t cluster_x, TensorStorage& shared_tensors) {
    using namespace cute;
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto block_tma_b = params.tma_load_b.get_slice(cluster_x);
    auto block_tma_b2 = params.tma_load_b2.get_slice(cluster_x);
    return cute::make_tuple(block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord)),
                            block_tma_b2.partition_S(get<3>(load_inputs)(_, _, n_coord, _, l_coord)),
                            block_tma_b.partition_D(sB));
  }

  // k tile k_tile's B (paired or not) or, past the first pair's tiles, B2, by TMA into the stage.
  template <class TensorB, class TensorB2, class TensorSB, class TensorMaps>
  CUTLASS_DEVICE static void load_b_tile(Params const& params, TensorMaps const& input_tensormaps,
                                         uint64_t* tma_barrier, uint16_t mcast_mask_b, TensorB const& tBgB,
                                         TensorB2 const& tBgB2, TensorSB& tBsB, TensorStorage& shared_tensors,
                                         int stage, int n_coord, int part, int k_tile, int k1_tiles) {
    using cute::_;
    if (k_tile >= k1_tiles) {
      copy(params.tma_load_b2.with(cute::get<3>(input_tensormaps), *tma_barrier, mcast_mask_b),
           tBgB2(_, _, _, k_tile - k1_tiles), tBsB(_, _, _, stage));
    } else if constexpr (kPairedB) {
      load_paired_b(cute::get<1>(input_tensormaps), tma_barrier, mcast_mask_b, shared_tensors, stage, n_coord, part,
                    k_tile);
    } else {
      copy(params.tma_load_b.with(cute::get<1>(input_tensormaps), *tma_barrier, mcast_mask_b), tBgB(_, _, _, k_tile),
           tBsB(_, _, _, stage));
    }
  }

  // Base::load's loop, each k tile from the pair it lies in, through the group's descriptors.
  template <class TensorA, class TensorB, class TensorA2, class TensorB2, class TensorMapA, class TensorMapB,
            class TensorMapA2, class TensorMapB2, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorA2, TensorB2, GatherGroup> const& load_inputs,
                           cute::tuple<TensorMapA, TensorMapB, TensorMapA2, TensorMapB2> const& input_tensormaps,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if constexpr (kGatherA) {
      load_gathered(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord, k_tile_iter,
                    k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
      return;
    }
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    const uint2 cluster_local_block_id = cluster_block_id(block_rank_in_cluster);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto block_tma_a = params.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_a2 = params.tma_load_a2.get_slice(cluster_local_block_id.y);
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAgA2 = block_tma_a2.partition_S(get<2>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    auto [tBgB, tBgB2, tBsB] =
        partition_b(params, load_inputs, n_coord, l_coord, cluster_local_block_id.x, shared_tensors);

    uint16_t mcast_mask_a = 0;
    if constexpr (is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
    }
    const uint16_t mcast_mask_b = mcast_mask_b_of(cluster_local_block_id);

    const int k1_tiles = k1_tiles_of(params.k1);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k_tile = *k_tile_iter;
      if (k_tile < k1_tiles) {
        copy(params.tma_load_a.with(get<0>(input_tensormaps), *tma_barrier, mcast_mask_a), tAgA(_, _, _, k_tile),
             tAsA(_, _, _, stage));
      } else {
        copy(params.tma_load_a2.with(get<2>(input_tensormaps), *tma_barrier, mcast_mask_a),
             tAgA2(_, _, _, k_tile - k1_tiles), tAsA(_, _, _, stage));
      }
      load_b_tile(params, input_tensormaps, tma_barrier, mcast_mask_b, tBgB, tBgB2, tBsB, shared_tensors, stage,
                  n_coord, cluster_local_block_id.x, k_tile, k1_tiles);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // Base::load's loop for a gathered A (kGatherA, the top of this file), run by the whole producer warp.
  template <class TensorA, class TensorB, class TensorA2, class TensorB2, class TensorMapA, class TensorMapB,
            class TensorMapA2, class TensorMapB2, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_gathered(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                    cute::tuple<TensorA, TensorB, TensorA2, TensorB2, GatherGroup> const& load_inputs,
                                    cute::tuple<TensorMapA, TensorMapB, TensorMapA2, TensorMapB2> const&
                                        input_tensormaps,
                                    BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                    int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    constexpr int kWarpThreads = cutlass::NumThreadsPerWarp;
    constexpr int kChunk = 16 / static_cast<int>(sizeof(InternalElementA));  // elements a 16-byte copy moves
    constexpr int kChunks = kBlockK / kChunk;                                  // of a row's k tile
    constexpr int kRowsPerLane = kBlockM / kWarpThreads;
    static_assert(kBlockM % kWarpThreads == 0 && kBlockK % kChunk == 0);
    const int lane = thread_idx % kWarpThreads;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    const uint2 cluster_local_block_id = cluster_block_id(block_rank_in_cluster);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    auto [tBgB, tBgB2, tBsB] =
        partition_b(params, load_inputs, n_coord, l_coord, cluster_local_block_id.x, shared_tensors);
    const uint16_t mcast_mask_b = mcast_mask_b_of(cluster_local_block_id);

    // This lane's rows of the tile (lane + 32 i): the slot each holds and A1's row for it, -1 past the
    // group's rows (32-bit: slots < 2^31, and the producer warp runs on 40 registers).
    const GatherGroup group = get<4>(load_inputs);
    int32_t slot[kRowsPerLane], a1_row[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int row = static_cast<int>(m_coord) * kBlockM + lane + kWarpThreads * i;
      slot[i] = row < group.rows ? static_cast<int32_t>(group.first_slot + row) : -1;
      a1_row[i] = slot[i] < 0 ? -1 : params.gather_rows != nullptr ? static_cast<int32_t>(params.gather_rows[slot[i]])
                                                                   : slot[i];
    }
    const int k1_tiles = k1_tiles_of(params.k1);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      auto token = pipeline.producer_try_acquire(smem_pipe_write);  // every lane waits for the stage
      while (token.get() != cutlass::BarrierStatus::WaitDone) token = pipeline.producer_try_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k_tile = *k_tile_iter;
      const bool first_pair = k_tile < k1_tiles;
      const int k0 = (first_pair ? k_tile : k_tile - k1_tiles) * kBlockK;
      const int k_end = first_pair ? params.k1 : params.k2;
      CUTLASS_PRAGMA_NO_UNROLL  // one row at a time: the producer warp has 40 registers
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int32_t r = first_pair ? a1_row[i] : slot[i];
        InternalElementA const* row = first_pair ? params.gather_a + int64_t(r < 0 ? 0 : r) * params.gather_lda
                                                 : params.gather_a2 + int64_t(r < 0 ? 0 : r) * params.gather_lda2;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kChunks; ++c) {
          const int k = k0 + c * kChunk;
          const bool copy = r >= 0 && k < k_end;
          copy_16_bytes(&sA(lane + kWarpThreads * i, c * kChunk, stage), copy ? row + k : row, copy);
        }
      }
      // Counted before the leader's arrive (the warp synchronizes between), so the phase waits for them.
      cutlass::arch::cpasync_barrier_arrive(pipeline.producer_get_barrier(smem_pipe_write));
      __syncwarp();
      pipeline.producer_acquire(smem_pipe_write, token);  // the leader: arrive, expecting B's bytes
      if (lane == 0) {
        load_b_tile(params, input_tensormaps, pipeline.producer_get_barrier(smem_pipe_write), mcast_mask_b, tBgB,
                    tBgB2, tBsB, shared_tensors, stage, n_coord, cluster_local_block_id.x, k_tile, k1_tiles);
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  // 16 bytes from global to shared memory by cp.async (L2 only), or 16 zero bytes when !copy.
  CUTLASS_DEVICE static void copy_16_bytes(void* smem, void const* gmem, bool copy) {
    const uint32_t smem_address = cute::cast_smem_ptr_to_uint(smem);
    const int src_bytes = copy ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address), "l"(gmem), "r"(src_bytes));
  }

  // One k tile of the paired B1 (paired_rows.h): this CTA's part of the box, multicast to the cluster's
  // CTAs sharing the tile when B is multicast. Rows of the K-major 128-byte-swizzled tile are 128 bytes
  // apart and the part's first row is a multiple of 8 (a whole swizzle atom), so it starts unswizzled.
  template <class Barrier>
  CUTLASS_DEVICE static void load_paired_b(cute::TmaDescriptor const* descriptor, Barrier* barrier,
                                           uint16_t mcast_mask, TensorStorage& shared_tensors, int stage, int n_tile,
                                           int part, int k_tile) {
    constexpr int kStageElements = kBlockN * kBlockK;
    static_assert(cute::cosize_v<SmemLayoutB> == kStageElements * DispatchPolicy::Stages,
                  "the paired B loads assume whole stages of BLK_N x BLK_K");
    static_assert((kBlockN / kClusterM) % 8 == 0, "each CTA's part must start on a swizzle atom");
    const int row0 = static_cast<int>(paired_rows_first_tile_row(part, kBlockN, kClusterM));
    auto* smem = shared_tensors.smem_B.data() + stage * kStageElements + row0 * kBlockK;
    const int j0 = static_cast<int>(paired_rows_j0(n_tile, part, kBlockN, kClusterM));
    const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
    auto* mbar = reinterpret_cast<uint64_t*>(barrier);
    if constexpr (cute::is_same_v<GmemTiledCopyB, cute::SM90_TMA_LOAD_MULTICAST>) {
      cute::SM90_TMA_LOAD_MULTICAST_3D::copy(descriptor, mbar, mcast_mask, hint, smem, k_tile * kBlockK, 0, j0);
    } else {
      cute::SM90_TMA_LOAD_3D::copy(descriptor, mbar, hint, smem, k_tile * kBlockK, 0, j0);
    }
  }

  // ---- the descriptors: Base's steps for A and B, and the same for A2 and B2
  CUTLASS_DEVICE auto tensormaps_init(Params const& params, TensorMapStorage& shared, int32_t sm_count,
                                      int32_t sm_idx) {
    cute::TmaDescriptor* gmem = reinterpret_cast<cute::TmaDescriptor*>(params.tensormaps);
    if (cute::elect_one_sync()) {
      const cute::TmaDescriptor* from[kTensorMaps] = {
          params.tma_load_a.get_tma_descriptor(),
          kPairedB ? &params.paired_b : params.tma_load_b.get_tma_descriptor(),
          params.tma_load_a2.get_tma_descriptor(), params.tma_load_b2.get_tma_descriptor()};
      cute::TmaDescriptor* to[kTensorMaps] = {&shared.smem_tensormap_A, &shared.smem_tensormap_B,
                                              &shared.smem_tensormap_A2, &shared.smem_tensormap_B2};
      for (int i = 0; i < kTensorMaps; ++i) {
        cute::copy(cute::recast<cute::uint128_t>(cute::make_tensor(from[i], cute::Int<1>{}, cute::Int<1>{})),
                   cute::recast<cute::uint128_t>(
                       cute::make_tensor(cute::make_smem_ptr(to[i]), cute::Int<1>{}, cute::Int<1>{})));
      }
    }
    __syncwarp();
    return cute::make_tuple(&gmem[sm_idx], &gmem[sm_idx + sm_count], &gmem[sm_idx + 2 * sm_count],
                            &gmem[sm_idx + 3 * sm_count]);
  }

  // One descriptor's dims and strides for a [rows, k] operand with the given stride (Base's
  // tensormaps_replace_global_tensor_properties, for one tensor).
  template <class Tma, class Element, class Stride>
  CUTLASS_DEVICE static void replace_dims_strides(cute::TmaDescriptor& smem_descriptor, Tma const& tma,
                                                  uint32_t rows, uint32_t k, Stride const& stride) {
    constexpr int kMaxTensorRank = 5;
    cute::array<uint32_t, kMaxTensorRank> shape = {1, 1, 1, 1, 1};
    cute::array<uint64_t, kMaxTensorRank> strides = {0, 0, 0, 0, 0};
    Element const* no_pointer = nullptr;
    cute::detail::fill_tma_gmem_shape_stride(
        tma, cute::make_tensor(no_pointer, cute::make_shape(rows, k, cute::Int<1>{}), stride), shape, strides);
    for (uint64_t& s : strides) s = (s * cute::sizeof_bits_v<Element>) / 8;
    cute::tma_descriptor_replace_dims_strides_in_shared_mem(smem_descriptor, shape, strides);
  }

  template <class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared, Params const& params,
                                                TensorMaps const& input_tensormaps,
                                                ProblemShape_MNKL problem_shape_mnkl, int32_t next_group) {
    if (!cute::elect_one_sync()) return;
    cute::tma_descriptor_replace_addr_in_shared_mem(shared.smem_tensormap_A, params.ptr_A[next_group]);
    cute::tma_descriptor_replace_addr_in_shared_mem(shared.smem_tensormap_B, params.ptr_B[next_group]);
    cute::tma_descriptor_replace_addr_in_shared_mem(shared.smem_tensormap_A2, params.ptr_A2[next_group]);
    cute::tma_descriptor_replace_addr_in_shared_mem(shared.smem_tensormap_B2, params.ptr_B2[next_group]);
    const uint32_t M = cute::get<0>(problem_shape_mnkl), N = cute::get<1>(problem_shape_mnkl);
    const uint32_t k1 = uint32_t(params.k1), k2 = uint32_t(params.k2);
    replace_dims_strides<TMA_A, InternalElementA>(shared.smem_tensormap_A, params.tma_load_a, M, k1,
                                                  params.dA[next_group]);
    if constexpr (!kPairedB) {  // the paired descriptor's dims and strides are every group's
      replace_dims_strides<TMA_B, InternalElementB>(shared.smem_tensormap_B, params.tma_load_b, N, k1,
                                                    params.dB[next_group]);
    }
    if (k2 == 0) return;  // no second pair: its descriptors are never used
    replace_dims_strides<TMA_A, InternalElementA>(shared.smem_tensormap_A2, params.tma_load_a2, M, k2,
                                                  params.dA2[next_group]);
    replace_dims_strides<TMA_B, InternalElementB>(shared.smem_tensormap_B2, params.tma_load_b2, N, k2,
                                                  params.dB2[next_group]);
  }

  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage& shared, TensorMaps const& input_tensormaps) {
    if (cute::elect_one_sync()) {
      cute::tma_desc_commit_group();
      cute::tma_desc_wait_group();
    }
    // The whole warp, aligned (as in Base)
    cute::tma_descriptor_cp_fence_release(cute::get<0>(input_tensormaps), shared.smem_tensormap_A);
    cute::tma_descriptor_cp_fence_release(cute::get<1>(input_tensormaps), shared.smem_tensormap_B);
    cute::tma_descriptor_cp_fence_release(cute::get<2>(input_tensormaps), shared.smem_tensormap_A2);
    cute::tma_descriptor_cp_fence_release(cute::get<3>(input_tensormaps), shared.smem_tensormap_B2);
  }

  template <class TensorMaps>
  CUTLASS_DEVICE void tensormaps_fence_acquire(TensorMaps const& input_tensormaps) {
    cute::tma_descriptor_fence_acquire(cute::get<0>(input_tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<1>(input_tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<2>(input_tensormaps));
    cute::tma_descriptor_fence_acquire(cute::get<3>(input_tensormaps));
  }
};

}  // namespace pykernels::gemm
