// How the Hopper GEMM core's gated mode (common/grouped_gemm_sm90.h, act_out set) reads an expert's
// gate_up weight. transformers stores it [2I, K]: I gate rows, then I up rows. The gated GEMM reads
// it as the B operand whose row n is
//
//   gate row n / 2 (n even), up row n / 2 (n odd)          paired_weight_row
//
// so D's columns 2j and 2j + 1 hold gate_j and up_j, side by side in one thread's accumulator
// registers (wgmma's accumulator and the epilogue's register fragments keep column pairs together),
// and the epilogue computes act(gate_j) * up_j there: no pass over [slots, 2I] for the activation
// (moe/gated_act_visitor_sm90.cuh). No reordered copy of the weight exists: B's TMA descriptor
// describes it as the 3-D tensor (k, half, j) -> weight[half * I + j][k], strides (1, I ldb, ldb)
// elements, whose box (BLK_K, 2, rows / 2) lands in shared memory as rows h + 2 jj, the paired order.
// With a cluster of cluster_m CTAs along M sharing each B tile by multicast, each loads
// 1 / cluster_m of it (the rows part * BLK_N / cluster_m onward).
//
// Torch- and CUDA-free: the mainloop (common/extended_k_array_mainloop_sm90.cuh), the launcher's
// check and the host tests (pykernels._C.host_logic) share it.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels::gemm {

PYKERNELS_HOST_DEVICE inline int64_t paired_weight_row(int64_t n, int64_t inner) { return n % 2 * inner + n / 2; }

// One TMA descriptor's geometry: dims and box fastest first, strides (bytes) of dims 1 and 2.
struct PairedRowsBox {
  uint64_t dims[3];
  uint64_t strides[2];
  uint32_t box[3];
};

inline PairedRowsBox paired_rows_box(int64_t inner, int64_t k, int64_t ldb, int64_t element_bytes, int64_t block_n,
                                     int64_t block_k, int64_t cluster_m) {
  PairedRowsBox b{};
  b.dims[0] = uint64_t(k), b.dims[1] = 2, b.dims[2] = uint64_t(inner);
  b.strides[0] = uint64_t(inner * ldb * element_bytes), b.strides[1] = uint64_t(ldb * element_bytes);
  b.box[0] = uint32_t(block_k), b.box[1] = 2, b.box[2] = uint32_t(block_n / 2 / cluster_m);
  return b;
}

// The box's j coordinate for the CTA at output column tile n_tile and cluster position part (its
// k and half coordinates: the k tile's first column, 0), and the first row of the CTA's B tile it fills.
PYKERNELS_HOST_DEVICE inline int64_t paired_rows_j0(int64_t n_tile, int64_t part, int64_t block_n, int64_t cluster_m) {
  return n_tile * (block_n / 2) + part * (block_n / 2 / cluster_m);
}
PYKERNELS_HOST_DEVICE inline int64_t paired_rows_first_tile_row(int64_t part, int64_t block_n, int64_t cluster_m) {
  return part * (block_n / cluster_m);
}

// What the pairing needs of a [2 inner, k] weight (n = 2 inner columns of D) on a tile of block_n
// columns, or null: whole pairs in every tile (no tile's box reads past the gate half into the up
// half), and TMA's limits (16-byte strides, dims below 2^32, 128-byte box rows for the 128-byte swizzle).
inline const char* paired_rows_error(int64_t n, int64_t k, int64_t ldb, int64_t element_bytes, int64_t block_n,
                                     int64_t block_k, int64_t cluster_m) {
  if (n < 2 || n % 2 != 0 || (n / 2) % (block_n / 2) != 0)
    return "the gated GEMM needs the gate and up halves (n / 2 rows each) in whole tiles: n / 2 a multiple of half "
           "the tile's columns";
  if (k < 1 || k >= (int64_t{1} << 32) || ldb < k || (ldb * element_bytes) % 16 != 0)
    return "the gated GEMM needs 1 <= k < 2^32, k <= ldb and 16-byte row strides";
  if (block_k * element_bytes != 128 || (block_n / 2) % cluster_m != 0 || block_n / 2 / cluster_m > 256)
    return "the gated GEMM's tile must have 128-byte k rows and a box of at most 256 row pairs";
  return nullptr;
}

}  // namespace pykernels::gemm
