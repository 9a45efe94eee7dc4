// A CUTLASS sm90 epilogue visitor (EVT node) for the gated gate_up GEMM (common/paired_rows.h): D's
// columns 2j and 2j + 1 are gate_j and up_j of a slot's row, and besides storing them (the gate_up
// pre-activation the backward needs, by the collective's TMA store) each pair becomes one element
// act_out[row, j] = act(gate_j) * up_j (moe/gated_act.h, rounded like the separate pass: from the bf16
// values D holds). The separate activation pass's read of [slots, 2I] is gone.
//
//   visit   each fragment's column pairs (the register order keeps a pair adjacent: the wgmma
//           accumulator, the stmatrix source partition); a pair found split traps instead of
//           writing a wrong value. Out-of-bounds rows (past the group's slots) are skipped.
//   rows    the group's (expert's) first slot from expert_offsets (common/gemm_groups.h), as the
//           setup kernel placed its D rows.
// Stores are plain 2-byte global stores: a quad of lanes writes 8 contiguous bytes of a row, a third
// of D's bytes on top of D's own stores.
#pragma once

#include <cstdint>

#include "common/gemm_groups.h"
#include "common/sm90_store_node.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/numeric_conversion.h"
#include "moe/gated_act.h"

namespace pykernels::moe::sm90 {

// (m, n) from the tile's corner of each of a thread's epilogue registers, indexed as the visitor's
// fragments are: (register, subtile row, subtile column). Not the collective's ConsumerStoreArgs::tCcD:
// it makes that from the layout of the thread's partition alone, so it counts from the thread's first
// register (its residue_tCcD likewise), and a thread placing its pairs by it writes them as if they began
// at row 0, column 0 (seen on the first GPU run: every fused test off by O(1) or NaN, D itself right).
// The same partition of the tile's identity tensor keeps the thread's offset, as CUTLASS's own store
// nodes partition their global tensors. Host-checked against the collective's absolute coordinates:
// tests/kernels/moe/test_gated_act_coords.py.
template <bool ReferenceSrc, class TileShapeMNK, class EpilogueTile, class TiledCopy>
CUTLASS_HOST_DEVICE auto tile_register_coords(TileShapeMNK tile_shape_mnk, EpilogueTile epi_tile,
                                              TiledCopy tiled_copy, int thread_idx) {
  return cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(
      cute::make_identity_tensor(cute::take<0, 2>(tile_shape_mnk)), epi_tile, tiled_copy, thread_idx);
}

template <class ElementOut>
struct Sm90GatedActStore : gemm::Sm90StoreNode {
  struct Arguments {
    void* act_out = nullptr;                 // [slots, inner] ElementOut
    const int64_t* expert_offsets = nullptr;  // the GEMM's groups (null: one group of every slot)
    int64_t experts = 1, slots = 0, inner = 0;
    GatedActSpec spec{};
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.act_out != nullptr && args.inner >= 1;
  }
  CUTLASS_HOST_DEVICE Sm90GatedActStore() {}
  CUTLASS_HOST_DEVICE Sm90GatedActStore(Params const& params, SharedStorage const&) : params(params) {}

  Params params;

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor tile_coords, Residue residue, ElementOut* rows, int n0,
                                          Params const& params)
        : tile_coords(tile_coords), residue(residue), rows(rows), n0(n0), params(params) {}

    CoordTensor tile_coords;  // (m, n) from the tile's corner, per register
    Residue residue;   // the problem's (M, N) from the same corner
    ElementOut* rows;  // act_out's row of the group's (and tile's) first row
    int n0;            // the tile's first column of D
    Params const& params;

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      static_assert(FragmentSize % 2 == 0, "the gated epilogue needs column pairs in every fragment");
      cutlass::NumericArrayConverter<ElementOut, ElementInput, FragmentSize> to_out;
      const cutlass::Array<ElementOut, FragmentSize> out = to_out(frg_input);
      cute::Tensor coord_mn = tile_coords(cute::_, cute::_, cute::_, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        const int v = epi_v * FragmentSize + i;
        const auto gate_mn = coord_mn(v), up_mn = coord_mn(v + 1);
        const int m = static_cast<int>(cute::get<0>(gate_mn)), n = static_cast<int>(cute::get<1>(gate_mn));
        if (cute::get<0>(up_mn) != m || cute::get<1>(up_mn) != n + 1 || (n0 + n) % 2 != 0) __trap();
        if (cute::elem_less(gate_mn, residue)) {
          const float act = gated_act(params.spec, static_cast<float>(out[i]), static_cast<float>(out[i + 1]));
          rows[int64_t(m) * params.inner + (n0 + n) / 2] = static_cast<ElementOut>(act);
        }
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int tile_m = cute::size<0>(args.tile_shape_mnk), tile_n = cute::size<1>(args.tile_shape_mnk);
    const SlotRange group = gemm::group_slots(params.expert_offsets, params.experts, params.slots, int64_t(l));
    ElementOut* rows =
        static_cast<ElementOut*>(params.act_out) + (group.begin + int64_t(m) * tile_m) * params.inner;
    auto tile_coords = tile_register_coords<ReferenceSrc>(args.tile_shape_mnk, args.epi_tile, args.tiled_copy,
                                                          args.thread_idx);
    return ConsumerStoreCallbacks<decltype(tile_coords), decltype(args.residue_cD)>(
        tile_coords, args.residue_cD, rows, static_cast<int>(n) * tile_n, params);
  }
};

}  // namespace pykernels::moe::sm90
