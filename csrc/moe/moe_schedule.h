// Index arithmetic of the grouped MoE kernels, shared by moe_routing.cu, moe_gemm.cu and the host
// tests (pykernels._C.host_logic): which slots each bucket owns, which (bucket, slots) row tile
// each CTA of a row-grouped GEMM gets, and the per-slot gather / scatter indices of the routing.
// Vocabulary as in moe.h: slots = T * k assignments a = t * k + j, expert e owns the slots
// [expert_offsets[e], expert_offsets[e + 1]), bucket E holds the dropped assignments.
//
// Every index read from routing data is clamped or bounds-checked here before it addresses memory:
// malformed routing gives wrong numbers, never an out-of-bounds access.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels::moe {

// ------------------------------------------------------------------ buckets
// The slots [begin, end) of a bucket, begin <= end, both in [0, slots].
struct SlotRange {
  int64_t begin, end;
};

PYKERNELS_HOST_DEVICE inline int64_t clamp_slot(int64_t v, int64_t slots) {
  return v < 0 ? int64_t{0} : (v > slots ? slots : v);
}

// The slots of bucket b (an expert, or b == experts: the dropped assignments), clamped into
// [0, slots] so that malformed offsets cannot address memory outside the operands.
PYKERNELS_HOST_DEVICE inline SlotRange bucket_slots(const int64_t* offsets,  // [experts + 1]
                                                    int64_t experts, int64_t slots, int64_t b) {
  const int64_t begin = clamp_slot(offsets[b], slots);
  const int64_t end = b < experts ? clamp_slot(offsets[b + 1], slots) : slots;
  return {begin, end > begin ? end : begin};
}

// The sort's bucket of an expert id: the id itself, or `experts` (dropped) outside [0, experts).
PYKERNELS_HOST_DEVICE inline int64_t expert_bucket(int64_t id, int64_t experts) {
  return id >= 0 && id < experts ? id : experts;
}

// ------------------------------------------------------------------ gather / scatter indices
// Token t and top-k slot j of assignment a = t * top_k + j; (-1, -1) for an a outside [0, slots).
struct AssignmentSource {
  int64_t token, k_slot;
};
PYKERNELS_HOST_DEVICE inline AssignmentSource assignment_source(int64_t a, int64_t slots, int64_t top_k) {
  if (a < 0 || a >= slots) return {-1, -1};
  return {a / top_k, a % top_k};
}

PYKERNELS_HOST_DEVICE inline int64_t assignment_of(int64_t token, int64_t k_slot, int64_t top_k) {
  return token * top_k + k_slot;
}

// slot_of_assignment's entry for the assignment held by slot s: s, or -1 when s lies in the dropped
// bucket (slots from valid_end = the dropped bucket's first slot on).
PYKERNELS_HOST_DEVICE inline int64_t kept_slot(int64_t s, int64_t valid_end) { return s < valid_end ? s : -1; }

// Row that slot s reads (map[s], or s without a map), -1 when it lies outside [0, rows).
PYKERNELS_HOST_DEVICE inline int64_t slot_row_index(const int64_t* map, int64_t s, int64_t rows) {
  const int64_t row = map != nullptr ? map[s] : s;
  return row >= 0 && row < rows ? row : -1;
}

// ------------------------------------------------------------------ row-tile schedule
// A row-grouped GEMM runs one CTA row per row tile: rows_per_tile consecutive slots of one bucket.
// Bucket b has ceil(size / rows_per_tile) tiles; tile_start (the exclusive scan of those counts)
// gives each bucket's first tile. The grid is sized before the offsets are known on the host:
// sum_b ceil(size_b / R) <= slots / R + (E + 1), so max_row_tiles CTAs always suffice for
// well-formed offsets (those past the last tile exit; malformed, overlapping offsets lose tiles).
PYKERNELS_HOST_DEVICE inline int64_t max_row_tiles(int64_t slots, int64_t experts, int64_t rows_per_tile) {
  return ceil_div(slots, rows_per_tile) + experts + 1;
}

PYKERNELS_HOST_DEVICE inline int64_t bucket_row_tiles(SlotRange bucket, int64_t rows_per_tile) {
  return ceil_div(bucket.end - bucket.begin, rows_per_tile);
}

// Bucket and first slot of row tile t < total tiles.
struct RowTileStart {
  int64_t bucket, first;
};
PYKERNELS_HOST_DEVICE inline RowTileStart row_tile_start(const int64_t* offsets,     // [experts + 1]
                                                         int64_t experts, int64_t slots,
                                                         const int64_t* tile_start,  // [experts + 1] scanned
                                                         int64_t rows_per_tile, int64_t t) {
  int64_t lo = 0, hi = experts;  // the last bucket whose first tile is <= t (empty buckets share starts)
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return {lo, bucket_slots(offsets, experts, slots, lo).begin + (t - tile_start[lo]) * rows_per_tile};
}

// One past the last slot of the row tile starting at `first` in `bucket`.
PYKERNELS_HOST_DEVICE inline int64_t row_tile_end(int64_t first, int64_t rows_per_tile, SlotRange bucket) {
  return first + rows_per_tile < bucket.end ? first + rows_per_tile : bucket.end;
}

// The rows GEMM's grid is one-dimensional: CTA c takes row tile c / column_tiles and column tile
// c % column_tiles. Column tiles innermost: the CTAs resident at once cover every column tile of a
// few row tiles, so a row tile's gathered operand rows come from HBM once and stay in L2 for its
// other column tiles, and its expert's weight tiles, shared by all its row tiles, come from L2 too.
// (Row tiles innermost re-read the gathered rows from HBM for every column tile.)
struct GridTile {
  int64_t row, column;
};
PYKERNELS_HOST_DEVICE inline GridTile grid_tile(int64_t cta, int64_t column_tiles) {
  return {cta / column_tiles, cta % column_tiles};
}

}  // namespace pykernels::moe
