// Grouped MoE CUDA kernels, routing side (declarations and the math in moe.h; the grouped GEMMs are
// in moe_gemm.cu, the shared helpers in moe_cuda_common.cuh).
//
// sort      counting sort by expert, deterministic and stable without atomics: one warp per chunk
//           of 1024 assignments counts its buckets (lanes with the same bucket grouped by
//           __match_any_sync), one block scans all counts in bucket-major order, and each warp
//           scatters its chunk again in assignment order from its chunk's first slot per bucket.
// maps      per-slot token / inverse-permutation / gate maps from the sorted routing.
// small     grid-stride element-wise kernels around the GEMMs: the (gated) sum over a token's k
// kernels   expert rows, the gather / gating of slot rows (16-byte packs when rows allow), the
//           zeroing of dropped rows, row dots and the reduction of the gate-gradient partials.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "common/tails.h"
#include "moe/gated_act.h"
#include "moe/moe.h"
#include "moe/moe_cuda_common.cuh"
#include "moe/moe_schedule.h"

namespace pykernels::moe {
using namespace detail;

namespace {

constexpr int kThreads = 256;  // element-wise kernels


// ------------------------------------------------------------------ sort
// counts[b * chunks + c] is chunk c's count of bucket b (an expert, or E for dropped ids). Scanned
// in this bucket-major order, it becomes the first slot of chunk c within bucket b: one flat scan
// gives both the stable per-chunk starts and expert_offsets[b] = counts[b * chunks].
constexpr int kSortChunk = 1024;  // assignments per warp: 32 rounds of 32
constexpr int kSortWarps = 4;     // warps per block

template <typename Index>
__device__ int64_t bucket_of(const Index* ids, int64_t a, int64_t slots, int64_t experts) {
  if (a >= slots) return -1;  // past the end: a bucket of its own, never counted
  return expert_bucket(ids[a], experts);
}

// One warp walks its chunk in rounds of 32 assignments, in order (what makes the sort stable).
// Lanes of a round with the same bucket form a group (__match_any_sync); `rank` is a lane's
// position in its group. Groups of one round have distinct buckets, so each group's leader moves
// cursor[bucket] without atomics. kScatter false: the cursors count; true: they start at the
// chunk's first slot per bucket and each assignment lands at cursor + rank. The cursors live in
// shared memory when E + 1 of them per warp fit, else in place in counts (stride chunks).
template <typename Index, bool kScatter>
__global__ void __launch_bounds__(32 * kSortWarps) sort_chunk_kernel(const Index* ids,  // [slots]
                                                                      int64_t slots, int64_t experts, int64_t chunks,
                                                                      int* counts,  // [experts + 1, chunks]
                                                                      bool shared_cursors,
                                                                      int64_t* sorted_expert_idx,
                                                                      int64_t* sorted_token_idx) {
  extern __shared__ int cursor_rows[];  // [kSortWarps, experts + 1] when shared_cursors
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunk = int64_t(blockIdx.x) * kSortWarps + warp;
  if (chunk >= chunks) return;  // whole warps
  const int64_t buckets = experts + 1;
  int* global = counts + chunk;  // this chunk's counts, stride chunks
  int* cursor = shared_cursors ? cursor_rows + warp * buckets : global;
  const int64_t stride = shared_cursors ? 1 : chunks;
  if (shared_cursors || !kScatter) {
    for (int64_t b = lane; b < buckets; b += 32) cursor[b * stride] = kScatter ? global[b * chunks] : 0;
    __syncwarp();
  }
  for (int64_t a0 = chunk * kSortChunk; a0 < (chunk + 1) * kSortChunk && a0 < slots; a0 += 32) {
    const int64_t a = a0 + lane;
    const int64_t bucket = bucket_of(ids, a, slots, experts);
    const unsigned group = __match_any_sync(0xffffffffu, bucket);
    const int rank = __popc(group & ((1u << lane) - 1));
    const int first = bucket >= 0 ? cursor[bucket * stride] : 0;
    if (kScatter && bucket >= 0) {
      sorted_expert_idx[first + rank] = bucket;
      sorted_token_idx[first + rank] = a;
    }
    __syncwarp();  // every lane has read its cursor before the leaders move it
    if (bucket >= 0 && rank == 0) cursor[bucket * stride] = first + __popc(group);
    __syncwarp();
  }
  if (!kScatter && shared_cursors) {
    for (int64_t b = lane; b < buckets; b += 32) global[b * chunks] = cursor[b];
  }
}

// counts -> each chunk's first slot per bucket (see above); expert_offsets [E + 1].
__global__ void __launch_bounds__(kScanThreads) sort_scan_kernel(int* counts, int64_t chunks, int64_t experts,
                                                                 int64_t* expert_offsets) {
  __shared__ BlockScan::TempStorage scratch;
  exclusive_scan(counts, (experts + 1) * chunks, scratch);
  for (int64_t b = threadIdx.x; b <= experts; b += kScanThreads)
    expert_offsets[b] = chunks > 0 ? counts[b * chunks] : 0;
}

// ------------------------------------------------------------------ per-slot maps
template <typename G>
__global__ void __launch_bounds__(kThreads) routing_maps_kernel(const RoutingMapsParams p) {
  const int64_t valid_end = bucket_slots(p.expert_offsets, p.experts, p.slots, p.experts).begin;
  const G* gates = static_cast<const G*>(p.gates);
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < p.slots; s += int64_t(gridDim.x) * blockDim.x) {
    const int64_t a = p.sorted_token_idx[s];
    const AssignmentSource source = assignment_source(a, p.slots, p.top_k);
    const bool in_range = source.token >= 0;
    if (p.token_of_slot != nullptr) p.token_of_slot[s] = source.token;
    if (p.slot_of_assignment != nullptr && in_range) p.slot_of_assignment[a] = kept_slot(s, valid_end);
    if (p.gate_of_slot != nullptr) p.gate_of_slot[s] = in_range && gates != nullptr ? to_float(gates[a]) : 0.0f;
  }
}

// ------------------------------------------------------------------ element-wise kernels
// kV consecutive elements of a row as fp32: one 16-byte access when kV elements fill 16 bytes (the
// launchers check alignment), else one access per element.
template <typename T, int kV>
__device__ __forceinline__ void load_pack(const T* src, float (&out)[kV]) {
  if constexpr (kV * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < kV; ++k) out[k] = to_float(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) out[k] = to_float(src[k]);
  }
}

template <typename T, int kV>
__device__ __forceinline__ void store_pack(T* dst, const float (&in)[kV]) {
  if constexpr (kV * sizeof(T) == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < kV; ++k) e[k] = from_float<T>(in[k]);
    *reinterpret_cast<uint4*>(dst) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < kV; ++k) dst[k] = from_float<T>(in[k]);
  }
}

// Each work item: kV consecutive columns of one output row.
template <typename T, int kV>
__global__ void __launch_bounds__(kThreads) sum_per_token_kernel(const SumPerTokenParams p) {
  const T* rows = static_cast<const T*>(p.rows);
  const int64_t slots = p.tokens * p.top_k, packs = p.cols / kV;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.tokens * packs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / packs, c = i % packs * kV;
    float sum[kV] = {};
    for (int64_t j = 0; j < p.top_k; ++j) {
      const int64_t s = p.slot_of_assignment[assignment_of(t, j, p.top_k)];
      if (s < 0 || s >= slots) continue;
      const float gate = p.gate_of_slot != nullptr ? p.gate_of_slot[s] : 1.0f;
      float v[kV];
      load_pack<T, kV>(rows + s * p.cols + c, v);
#pragma unroll
      for (int k = 0; k < kV; ++k) sum[k] += v[k] * gate;
    }
    store_pack<T, kV>(static_cast<T*>(p.out) + t * p.cols + c, sum);
  }
}

template <typename T, int kV>
__global__ void __launch_bounds__(kThreads) scale_rows_kernel(const ScaleRowsParams p) {
  const int64_t packs = p.src.cols / kV;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.slots * packs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = i / packs, c = i % packs * kV;
    const T* src = slot_row<T>(p.src, s);
    const float gate = p.gate_of_slot != nullptr ? p.gate_of_slot[s] : 1.0f;
    float v[kV] = {};
    if (src != nullptr) load_pack<T, kV>(src + c, v);
#pragma unroll
    for (int k = 0; k < kV; ++k) v[k] *= gate;
    store_pack<T, kV>(static_cast<T*>(p.out) + s * p.ld_out + c, v);
  }
}

// The gated activation (gated_act.h), forward when p.grad_inner is null. Each work item: kV
// consecutive columns j of one row of inner (kV = 16 bytes of elements where the launcher found
// everything aligned: 16-byte loads of gate, up and grad_inner, 16-byte stores). Interleaved rows
// hold (gate, up) pairs: the item's 2 kV gate_up elements are contiguous, read as two packs. The
// backward writes grad_gate_up interleaved or not by kGradInterleaved (gate_up's layout unless asked).
template <typename T, int kV, bool kInterleaved, bool kGradInterleaved = kInterleaved>
__global__ void __launch_bounds__(kThreads) gated_act_kernel(const GatedActParams p) {
  const T* gate_up = static_cast<const T*>(p.gate_up);
  const int64_t packs = p.inner / kV;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.rows * packs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / packs, j = i % packs * kV;
    const T* row = gate_up + r * 2 * p.inner;
    float gate[kV], up[kV];
    if constexpr (kInterleaved) {
      float pairs[2][kV];
      load_pack<T, kV>(row + 2 * j, pairs[0]);
      load_pack<T, kV>(row + 2 * j + kV, pairs[1]);
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        gate[k] = pairs[(2 * k) / kV][(2 * k) % kV];
        up[k] = pairs[(2 * k + 1) / kV][(2 * k + 1) % kV];
      }
    } else {
      load_pack<T, kV>(row + j, gate);
      load_pack<T, kV>(row + p.inner + j, up);
    }
    if (p.grad_inner == nullptr) {
      float inner[kV];
#pragma unroll
      for (int k = 0; k < kV; ++k) inner[k] = gated_act(p.spec, gate[k], up[k]);
      store_pack<T, kV>(static_cast<T*>(p.out) + r * p.inner + j, inner);
      continue;
    }
    float grad[kV], d_gate[kV], d_up[kV];
    load_pack<T, kV>(static_cast<const T*>(p.grad_inner) + r * p.inner + j, grad);
#pragma unroll
    for (int k = 0; k < kV; ++k) {
      const GatedActGrad d = gated_act_grad(p.spec, gate[k], up[k], grad[k]);
      d_gate[k] = d.gate, d_up[k] = d.up;
    }
    T* out = static_cast<T*>(p.out) + r * 2 * p.inner;
    if constexpr (kGradInterleaved) {
      float pairs[2][kV];
#pragma unroll
      for (int k = 0; k < kV; ++k) {
        pairs[(2 * k) / kV][(2 * k) % kV] = d_gate[k];
        pairs[(2 * k + 1) / kV][(2 * k + 1) % kV] = d_up[k];
      }
      store_pack<T, kV>(out + 2 * j, pairs[0]);
      store_pack<T, kV>(out + 2 * j + kV, pairs[1]);
    } else {
      store_pack<T, kV>(out + j, d_gate);
      store_pack<T, kV>(out + p.inner + j, d_up);
    }
  }
}

// One block per group of kZeroRowsPerBlock slots; only blocks reaching the dropped bucket write.
constexpr int kZeroRowsPerBlock = 8;
template <typename T>
__global__ void __launch_bounds__(kThreads) zero_dropped_rows_kernel(const ZeroDroppedRowsParams p) {
  const int64_t valid_end = bucket_slots(p.expert_offsets, p.experts, p.slots, p.experts).begin;
  const int64_t first = int64_t(blockIdx.x) * kZeroRowsPerBlock;
  if (first + kZeroRowsPerBlock <= valid_end) return;
  for (int64_t i = threadIdx.x; i < kZeroRowsPerBlock * p.cols; i += blockDim.x) {
    const int64_t s = first + i / p.cols;
    if (s >= valid_end && s < p.slots) static_cast<T*>(p.out)[s * p.ld + i % p.cols] = from_float<T>(0.0f);
  }
}

// One warp per slot.
template <typename T>
__global__ void __launch_bounds__(kThreads) row_dots_kernel(const RowDotsParams p) {
  const int64_t s = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (s >= p.slots) return;
  const T* a = slot_row<T>(p.a, s);
  const T* b = slot_row<T>(p.b, s);
  float sum = 0.0f;
  if (a != nullptr && b != nullptr)
    for (int64_t c = lane; c < p.a.cols; c += 32) sum += to_float(a[c]) * to_float(b[c]);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) p.dots[s] = sum;
}

template <typename G>
__global__ void __launch_bounds__(kThreads) gate_grad_kernel(const GateGradParams p) {
  for (int64_t a = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; a < p.slots; a += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = p.slot_of_assignment[a];
    float sum = 0.0f;
    if (s >= 0 && s < p.slots) {
      for (int64_t i = 0; i < p.column_tiles; ++i) sum += p.dgate_partial[i * p.slots + s];
    }
    static_cast<G*>(p.grad_gates)[a] = from_float<G>(sum);
  }
}

}  // namespace

// ------------------------------------------------------------------ launchers
int64_t sort_workspace_bytes(const SortParams& p) {
  return ceil_div(p.slots, kSortChunk) * (p.experts + 1) * int64_t(sizeof(int));
}

const char* launch_sort_tokens(const SortParams& p, void* workspace, cudaStream_t stream) {
  if (p.slots < 0 || p.slots > INT32_MAX || p.experts < 1 || p.experts >= INT32_MAX)
    return fail("moe sort: need 0 <= T * k < 2^31 and 1 <= num_experts < 2^31, got " + std::to_string(p.slots) +
                " assignments and " + std::to_string(p.experts) + " experts");
  const int64_t chunks = ceil_div(p.slots, kSortChunk);
  if ((p.experts + 1) * chunks > INT32_MAX) return "moe sort: num_experts * T * k / 1024 must be below 2^31";
  int* counts = static_cast<int*>(workspace);
  const int blocks = static_cast<int>(ceil_div(chunks, kSortWarps));
  const int64_t cursor_bytes = kSortWarps * (p.experts + 1) * int64_t(sizeof(int));
  const bool shared_cursors = cursor_bytes <= 48 * 1024;  // E < 3072: no opt-in needed
  const size_t smem = shared_cursors ? static_cast<size_t>(cursor_bytes) : 0;
  const auto run = [&](auto index) {
    using Index = decltype(index);
    const Index* ids = static_cast<const Index*>(p.top_k_index);
    if (chunks > 0)
      sort_chunk_kernel<Index, false><<<blocks, 32 * kSortWarps, smem, stream>>>(
          ids, p.slots, p.experts, chunks, counts, shared_cursors, nullptr, nullptr);
    sort_scan_kernel<<<1, kScanThreads, 0, stream>>>(counts, chunks, p.experts, p.expert_offsets);
    if (chunks > 0)
      sort_chunk_kernel<Index, true><<<blocks, 32 * kSortWarps, smem, stream>>>(
          ids, p.slots, p.experts, chunks, counts, shared_cursors, p.sorted_expert_idx, p.sorted_token_idx);
    return launch_status("moe sort: kernel launch failed");
  };
  return p.index_is_int64 ? run(int64_t{}) : run(int32_t{});
}

const char* launch_routing_maps(const RoutingMapsParams& p, cudaStream_t stream) {
  if (p.slots == 0) return nullptr;
  if (p.top_k < 1) return "moe routing maps: top_k must be >= 1";
  return with_element(p.gates_dtype, [&](auto gate) {
    routing_maps_kernel<decltype(gate)><<<grid_for(p.slots, kThreads), kThreads, 0, stream>>>(p);
    return launch_status("moe routing maps: kernel launch failed");
  });
}

// Whether rows of `cols` elements of T (row stride ld) at base move in 16-byte packs.
template <typename T>
bool packs_of_16_bytes(const void* base, int64_t ld, int64_t cols) {
  return rows_vector_aligned(base, ld, cols, 16 / sizeof(T), sizeof(T));
}

const char* launch_sum_per_token(const SumPerTokenParams& p, cudaStream_t stream) {
  if (p.tokens * p.cols == 0) return nullptr;
  return with_element(p.dtype, [&](auto element) {
    using T = decltype(element);
    constexpr int kV = 16 / sizeof(T);
    if (packs_of_16_bytes<T>(p.rows, p.cols, p.cols) && packs_of_16_bytes<T>(p.out, p.cols, p.cols))
      sum_per_token_kernel<T, kV><<<grid_for(p.tokens * p.cols / kV, kThreads), kThreads, 0, stream>>>(p);
    else
      sum_per_token_kernel<T, 1><<<grid_for(p.tokens * p.cols, kThreads), kThreads, 0, stream>>>(p);
    return launch_status("moe sum per token: kernel launch failed");
  });
}

const char* launch_scale_rows(const ScaleRowsParams& p, cudaStream_t stream) {
  if (p.slots * p.src.cols == 0) return nullptr;
  return with_element(p.dtype, [&](auto element) {
    using T = decltype(element);
    constexpr int kV = 16 / sizeof(T);
    if (packs_of_16_bytes<T>(p.src.data, p.src.ld, p.src.cols) && packs_of_16_bytes<T>(p.out, p.ld_out, p.src.cols))
      scale_rows_kernel<T, kV><<<grid_for(p.slots * p.src.cols / kV, kThreads), kThreads, 0, stream>>>(p);
    else
      scale_rows_kernel<T, 1><<<grid_for(p.slots * p.src.cols, kThreads), kThreads, 0, stream>>>(p);
    return launch_status("moe scale rows: kernel launch failed");
  });
}

const char* launch_gated_act(const GatedActParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return nullptr;
  return with_element(p.dtype, [&](auto element) {
    using T = decltype(element);
    constexpr int kV = 16 / sizeof(T);
    const int64_t out_cols = p.grad_inner != nullptr ? 2 * p.inner : p.inner;
    const bool packed = p.inner % kV == 0 && packs_of_16_bytes<T>(p.gate_up, 2 * p.inner, 2 * p.inner) &&
                        packs_of_16_bytes<T>(p.out, out_cols, out_cols) &&
                        (p.grad_inner == nullptr || packs_of_16_bytes<T>(p.grad_inner, p.inner, p.inner));
    const int blocks = grid_for(p.rows * p.inner / (packed ? kV : 1), kThreads);
    if (p.grad_inner != nullptr && p.grad_interleaved != p.interleaved) {  // a backward changing layout
      if (packed && p.interleaved) {
        gated_act_kernel<T, kV, true, false><<<blocks, kThreads, 0, stream>>>(p);
      } else if (packed) {
        gated_act_kernel<T, kV, false, true><<<blocks, kThreads, 0, stream>>>(p);
      } else if (p.interleaved) {
        gated_act_kernel<T, 1, true, false><<<blocks, kThreads, 0, stream>>>(p);
      } else {
        gated_act_kernel<T, 1, false, true><<<blocks, kThreads, 0, stream>>>(p);
      }
    } else if (packed && p.interleaved) {
      gated_act_kernel<T, kV, true><<<blocks, kThreads, 0, stream>>>(p);
    } else if (packed) {
      gated_act_kernel<T, kV, false><<<blocks, kThreads, 0, stream>>>(p);
    } else if (p.interleaved) {
      gated_act_kernel<T, 1, true><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      gated_act_kernel<T, 1, false><<<blocks, kThreads, 0, stream>>>(p);
    }
    return launch_status("moe gated activation: kernel launch failed");
  });
}

const char* launch_zero_dropped_rows(const ZeroDroppedRowsParams& p, cudaStream_t stream) {
  if (p.slots * p.cols == 0) return nullptr;
  const int64_t blocks = ceil_div(p.slots, kZeroRowsPerBlock);
  if (blocks > INT32_MAX) return "moe zero dropped rows: too many slots";
  return with_element(p.dtype, [&](auto element) {
    zero_dropped_rows_kernel<decltype(element)><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
    return launch_status("moe zero dropped rows: kernel launch failed");
  });
}

const char* launch_row_dots(const RowDotsParams& p, cudaStream_t stream) {
  if (p.slots == 0) return nullptr;
  const int64_t blocks = ceil_div(p.slots * 32, kThreads);
  if (blocks > INT32_MAX) return "moe row dots: too many slots";
  return with_element(p.dtype, [&](auto element) {
    row_dots_kernel<decltype(element)><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
    return launch_status("moe row dots: kernel launch failed");
  });
}

const char* launch_gate_grad(const GateGradParams& p, cudaStream_t stream) {
  if (p.slots == 0) return nullptr;
  return with_element(p.gates_dtype, [&](auto gate) {
    gate_grad_kernel<decltype(gate)><<<grid_for(p.slots, kThreads), kThreads, 0, stream>>>(p);
    return launch_status("moe gate grad: kernel launch failed");
  });
}

}  // namespace pykernels::moe
