// A CUTLASS sm90 epilogue visitor (EVT node) that turns the logits tile in registers into softmax
// partials (common/online_softmax.h) per (row, CTA tile), so the logits never reach global memory.
//
// Modelled on CUTLASS's Sm90ColReduction with FinalReduction = false (one value per (row, N tile)
// in a compact m-major buffer), reducing the triple (max_z, sum_exp, sum_exp_z) instead of one
// value, which no single-op reduction can do: sum_exp is relative to a max that is not known until
// the row has been seen.
//   visit   each thread folds each of its in-bounds logits z = scale * acc into its register
//           partial of z's row (add_logit with the call's slack: one exp per logit, a second where
//           the row's reference moves); the registers of one row alias
//           across N (stride-0 mode), as in Sm90ColReduction.
//   reduce  after the tile's last epilogue subtile: a shuffle tree over the lanes that share a row
//           (merge_partials), then the lane holding column 0 writes the three planes. In the
//           cooperative wgmma layout each warp owns whole rows of the tile (warps split M only),
//           so no shared-memory stage is needed: a static_assert holds the kernel to that.
#pragma once

#include "common/online_softmax.h"
#include "common/sm90_store_node.cuh"
#include "cute/tensor.hpp"
#include "logprobs/vocab_chunks.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace pykernels::logprobs::sm90 {

// The planes' layout, (row, N tile) of the (M, N, L) problem -> offset: CUTLASS's compact m-major
// per-tile column-reduction buffer, which logprobs/vocab_chunks.h spells as partial_index (a
// static_assert in logprobs_sm90.cu holds the two together).
template <class CtaTileMN, class ShapeMNL>
CUTE_HOST_DEVICE constexpr auto partials_plane_layout(CtaTileMN tile_mn, ShapeMNL shape_mnl) {
  auto tile_layout = cute::make_layout(tile_mn, cute::make_stride(cute::_1{}, cute::_0{}));
  return cute::blocked_product(tile_layout, cute::make_layout(cute::ceil_div(shape_mnl, cute::shape(tile_layout))));
}

template <class CtaTileShapeMNK>
struct Sm90SoftmaxPartials : gemm::Sm90StoreNode {
  // Gives the collective an element type for its (unused) D staging when D is void.
  using ElementAux = float;

  struct Arguments {
    float* max_z = nullptr;  // each compact m-major (round_up(M, CTA_M), ceil_div(N, CTA_N))
    float* sum_exp = nullptr;
    float* sum_exp_z = nullptr;
    float scale = 1.0f;  // z = scale * acc
    float slack = 0.0f;  // add_logit's: 0 the running max, kLazyMaxSlack the lazy reference
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.max_z != nullptr && args.sum_exp != nullptr && args.sum_exp_z != nullptr;
  }
  CUTLASS_HOST_DEVICE Sm90SoftmaxPartials() {}
  CUTLASS_HOST_DEVICE Sm90SoftmaxPartials(Params const& params, SharedStorage const&) : params(params) {}

  Params params;

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}

    ArgsTuple args_tuple;
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      auto& [ref_src, r_max, r_sum, r_sum_z, tCcCol, plane_layout, lane_layout_MN, lane_mn, tile_coord_mnkl, cCol,
             residue_cCol, residue_tCcCol, epi_tile, tiled_copy, thread_idx] = args_tuple;
      cute::Tensor max_mn = r_max(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor sum_mn = r_sum(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor sum_z_mn = r_sum_z(cute::_, cute::_, cute::_, epi_m, epi_n);
      cute::Tensor coord_mn = tCcCol(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int v = epi_v * FragmentSize + i;
        if (cute::elem_less(coord_mn(v), residue_tCcCol)) {  // columns past the vocabulary are not logits
          const SoftmaxPartial p =
              add_logit({max_mn(v), sum_mn(v), sum_z_mn(v)}, params.scale * static_cast<float>(frg_input[i]),
                        params.slack);
          max_mn(v) = p.max_z;
          sum_mn(v) = p.sum_exp;
          sum_z_mn(v) = p.sum_exp_z;
        }
      }
      return frg_input;
    }

    // This thread's row registers into plane (one CTA tile's column of partials).
    template <bool kReferenceSrc, class Registers, class PlaneLayout, class EpiTile, class TiledCopy>
    CUTLASS_DEVICE static void write_plane(Registers const& registers, float* plane, PlaneLayout plane_layout, int m,
                                           int n, int l, EpiTile epi_tile, TiledCopy tiled_copy, int thread_idx) {
      cute::Tensor g_plane = cute::local_tile(cute::make_tensor(cute::make_gmem_ptr(plane), plane_layout),
                                              cute::take<0, 2>(CtaTileShapeMNK{}), cute::make_coord(m, cute::_, cute::_));
      cute::Tensor tCgBuf = cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<kReferenceSrc>(
          g_plane(cute::_, cute::_, n, l), epi_tile, tiled_copy, thread_idx);
      cute::copy_aligned(registers, tCgBuf);
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& sync_fn, int, int, bool is_last_iteration, VTensor) {
      if (!is_last_iteration) return;
      auto& [ref_src, r_max, r_sum, r_sum_z, tCcCol, plane_layout, lane_layout_MN, lane_mn, tile_coord_mnkl, cCol,
             residue_cCol, residue_tCcCol, epi_tile, tiled_copy, thread_idx] = args_tuple;
      constexpr bool kReferenceSrc = decltype(ref_src)::value;
      auto [m, n, k, l] = tile_coord_mnkl;
      if (!cute::elem_less(cCol(cute::_0{}, cute::_0{}), residue_cCol)) return;  // a CTA wholly out of bounds

      // 1. Shuffle tree over the lanes that share a row; lane column 0 ends with the row's partial.
      cute::Tensor f_max = cute::filter(r_max);  // one register per distinct row
      cute::Tensor f_sum = cute::filter(r_sum);
      cute::Tensor f_sum_z = cute::filter(r_sum_z);
      CUTLASS_PRAGMA_UNROLL
      for (int cols = cute::size<1>(lane_layout_MN) / 2; cols > 0; cols /= 2) {
        const int delta = lane_layout_MN(cute::_0{}, cols);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < cute::size(f_max); ++i) {
          const SoftmaxPartial other{__shfl_down_sync(0xffffffffu, f_max(i), delta),
                                     __shfl_down_sync(0xffffffffu, f_sum(i), delta),
                                     __shfl_down_sync(0xffffffffu, f_sum_z(i), delta)};
          const SoftmaxPartial merged = merge_partials({f_max(i), f_sum(i), f_sum_z(i)}, other);
          f_max(i) = merged.max_z;
          f_sum(i) = merged.sum_exp;
          f_sum_z(i) = merged.sum_exp_z;
        }
      }

      // 2. The reduced lanes write this tile's partials (the planes' padding rows take the
      //    out-of-bounds rows' empty partials).
      if (cute::get<1>(lane_mn) == 0) {
        write_plane<kReferenceSrc>(r_max, params.max_z, plane_layout, m, n, l, epi_tile, tiled_copy, thread_idx);
        write_plane<kReferenceSrc>(r_sum, params.sum_exp, plane_layout, m, n, l, epi_tile, tiled_copy, thread_idx);
        write_plane<kReferenceSrc>(r_sum_z, params.sum_exp_z, plane_layout, m, n, l, epi_tile, tiled_copy,
                                   thread_idx);
      }
      sync_fn();
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    Layout ref_layout_MN = [&]() {  // tile_mn -> tv_idx
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();

    // Which lanes share a row (the shuffle tree) and whether warps split N (they must not).
    constexpr int kWarpSize = cutlass::NumThreadsPerWarp;
    using W = Int<decltype(args.tiled_copy)::TiledNumThr::value / kWarpSize>;
    Layout tv2lane = Layout<Shape<Int<kWarpSize>, W, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    Layout inv_lane_layout_MN = right_inverse(lane_layout_MN);
    const int lane_idx = cutlass::canonical_lane_idx();
    auto lane_mn = idx2crd(inv_lane_layout_MN(lane_idx), shape(lane_layout_MN));
    Layout tv2warp = Layout<Shape<Int<kWarpSize>, W, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    static_assert(decltype(size<1>(warp_layout_MN))::value <= 1,
                  "warps split the tile's N: this visitor has no shared-memory reduction stage");

    // Per-row registers: partition a (M, N) view with stride 0 along N (the rows' aliases).
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    static_assert(decltype(size<0>(args.tile_shape_mnk))::value == size<0>(CtaTileShapeMNK{}));
    Tensor m_row = make_tensor(make_gmem_ptr<float>(params.max_z), make_shape(M, N, L), Stride<_1, _0, _0>{});
    Tensor g_row = local_tile(m_row, take<0, 2>(args.tile_shape_mnk), make_coord(m, n, _));
    Tensor tCgRow = cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        g_row(_, _, l), args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor r_max = make_tensor_like<float>(tCgRow);
    Tensor r_sum = make_tensor_like<float>(tCgRow);
    Tensor r_sum_z = make_tensor_like<float>(tCgRow);
    fill(r_max, -INFINITY);  // the empty partial
    fill(r_sum, 0.0f);
    fill(r_sum_z, 0.0f);

    // The planes: (row, N tile) at tile * partial_rows(M) + row (logprobs/vocab_chunks.h): the layout
    // of a problem of partial_rows(M) rows, the same for every tile height that divides kSm90RowPad.
    static_assert(kSm90RowPad % decltype(size<0>(args.tile_shape_mnk))::value == 0);
    const int rows_padded = static_cast<int>(partial_rows(M));
    Layout plane_layout = partials_plane_layout(take<0, 2>(args.tile_shape_mnk), make_shape(rows_padded, N, L));

    auto args_tuple = make_tuple(bool_constant<ReferenceSrc>{}, cute::move(r_max), cute::move(r_sum),
                                 cute::move(r_sum_z), args.tCcD, plane_layout, lane_layout_MN, lane_mn,
                                 args.tile_coord_mnkl, args.cD, args.residue_cD, args.residue_tCcD, args.epi_tile,
                                 args.tiled_copy, args.thread_idx);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace pykernels::logprobs::sm90
