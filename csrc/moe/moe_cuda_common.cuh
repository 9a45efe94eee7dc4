// Shared helpers of the grouped MoE CUDA kernels (moe_routing.cu: sort, routing maps, element-wise
// kernels; moe_gemm.cu: grouped GEMMs): launch error messages, the slot rows every kernel
// addresses memory through, and the one-block scan of the sort and of the GEMM row-tile schedule
// (the dtype dispatch is common/cuda_convert.cuh's). Declarations and the math are in moe.h; the
// index arithmetic (bucket ranges, tile schedule, gather / scatter indices), shared with the host
// tests, in moe_schedule.h.
//
// Everything lives in pykernels::moe::detail; the .cu files pull it in with a using-directive.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <string>

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "moe/moe.h"
#include "moe/moe_schedule.h"

namespace pykernels::moe::detail {


// Row of slot s in a SlotRows operand, null when the row lies outside the matrix.
template <typename E>
__device__ const E* slot_row(const SlotRows& op, int64_t s) {
  const int64_t row = slot_row_index(op.map, s, op.rows);
  return row >= 0 ? static_cast<const E*>(op.data) + row * op.ld : nullptr;
}

// ------------------------------------------------------------------ block-wide scans
constexpr int kScanThreads = 1024;
using BlockScan = cub::BlockScan<int64_t, kScanThreads>;

// values[i] = sum_{j < i} values[j] for i < n, in place, by one block; returns the total.
template <typename V>
__device__ int64_t exclusive_scan(V* values, int64_t n, BlockScan::TempStorage& scratch) {
  int64_t carry = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kScanThreads) {
    const int64_t i = i0 + threadIdx.x;
    const int64_t value = i < n ? values[i] : 0;
    int64_t before, total;
    BlockScan(scratch).ExclusiveSum(value, before, total);
    if (i < n) values[i] = static_cast<V>(carry + before);
    carry += total;
    __syncthreads();  // scratch is reused by the next tile; the writes are visible after the loop
  }
  return carry;
}

}  // namespace pykernels::moe::detail
