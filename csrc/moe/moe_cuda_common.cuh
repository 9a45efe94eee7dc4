// Shared helpers of the grouped MoE CUDA kernels (moe_routing.cu: sort, routing maps, element-wise
// kernels; moe_gemm.cu: grouped GEMMs): launch error messages, the clamped bucket ranges and slot
// rows every kernel addresses memory through, and the one-block scan of the sort and of the GEMM
// row-tile schedule (the dtype dispatch is common/cuda_convert.cuh's). Declarations and the math
// are in moe.h.
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
#include "moe/moe.h"

namespace pykernels::moe::detail {

// Keeps the message alive until this thread's next failure (launchers return it as const char*).
inline const char* fail(std::string message) {
  thread_local std::string last;
  last = std::move(message);
  return last.c_str();
}

inline const char* launch_status(const char* what) {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? nullptr : fail(std::string(what) + ": " + cudaGetErrorString(status));
}

inline __host__ __device__ int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The slots of bucket b (an expert, or b == experts: the dropped assignments), clamped into
// [0, slots] so that malformed offsets cannot address memory outside the operands.
struct SlotRange {
  int64_t begin, end;
};
inline __device__ SlotRange bucket_slots(const int64_t* offsets, int64_t experts, int64_t slots, int64_t b) {
  auto clamp = [slots](int64_t v) { return v < 0 ? int64_t{0} : (v > slots ? slots : v); };
  const int64_t begin = clamp(offsets[b]);
  const int64_t end = b < experts ? clamp(offsets[b + 1]) : slots;
  return {begin, end > begin ? end : begin};
}

// Row of slot s in a SlotRows operand, null when the row lies outside the matrix.
template <typename E>
__device__ const E* slot_row(const SlotRows& op, int64_t s) {
  const int64_t row = op.map != nullptr ? op.map[s] : s;
  return row >= 0 && row < op.rows ? static_cast<const E*>(op.data) + row * op.ld : nullptr;
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
