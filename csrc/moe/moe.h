// Grouped MoE GEMM: shared declarations of the CUDA implementation (torch-free: included by .cu
// files that must compile against a CPU-only torch). The ops (schemas in csrc/torch_bindings.cpp,
// CPU in moe_cpu.cpp) are composed from these launchers in moe_cuda_torch.cpp.
//
// Vocabulary: T tokens, k experts per token, slots = T * k assignments a = t * k + j. A slot s is a
// position in expert order (moe_sort_tokens); sorted_token_idx[s] is the assignment it holds and
// expert e owns the slots [expert_offsets[e], expert_offsets[e + 1]). Slots past expert_offsets[E]
// hold dropped assignments (ids outside [0, E)): they form a last bucket E whose rows are zeros.
//
// Every launcher reads the routing on the device only (no host synchronization) and returns
// nullptr on success, else a message. Routing values are not validated on the device (that needs a
// host sync, which the CPU op does); instead every index is clamped or bounds-checked before it
// addresses memory, so malformed routing gives wrong numbers, never an out-of-bounds access.
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/two_way_choice.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::moe {

// PYKERNELS_SM90_MOE_LORA (`setting`; null or empty: the default) says how the Hopper path runs the
// experts' LoRA products on the base's rows (u B_e^T forward, v A_e for grad_x):
//   extra_k   as extra K of the base's grouped GEMM (common/grouped_gemm_sm90.h): the default
//   separate  as their own grouped GEMMs accumulating into the rows (a second pass over them)
// Read on every call, so one process can time both (benchmarks/tile_sweep.py). Null on success,
// else a message naming the choices.
inline const char* moe_lora_separate_for(const char* setting, bool* separate) {
  return two_way_choice(setting, "extra_k", "separate",
                        "PYKERNELS_SM90_MOE_LORA must be extra_k (the default) or separate", separate);
}

// PYKERNELS_SM90_MOE_GATHER picks how the Hopper expert GEMMs read rows by token: x in the gate_up
// forward's gated GEMM (PYKERNELS_SM90_MOE_ACT=epilogue) and dy in grad_x of a weight stored [E, out,
// in] when no weight gradient is asked (the frozen experts of LoRA training):
//   pass      a pass copies the rows into slot order for the GEMM's TMA loads (the default)
//   mainloop  the GEMM's producer warp copies them by 16-byte cp.async straight into its pipeline
//             (common/extended_k_array_mainloop_sm90.cuh, kGatherA): no [T*k, *] copy in memory
// Read on every call; sets *mainloop. Null on success, else a message naming the choices.
inline const char* moe_gather_in_mainloop_for(const char* setting, bool* mainloop) {
  return two_way_choice(setting, "pass", "mainloop", "PYKERNELS_SM90_MOE_GATHER must be pass (the default) or mainloop",
                        mainloop);
}

// PYKERNELS_MOE_RANK_TILE picks the output tile of the sm80 tensor-op GEMMs (on Hopper too) with one
// side of at most kNarrowRankColumns: the LoRA rank-r products u = x A_e^T, v = dy B_e, dB_e and dA_e
// (r padded to 8), and any other product that narrow (tiny models):
//   wide    128 x 128, as every other product (the default): r 16 fills 16 of its 128 columns, so
//           those four products issue 8x the MMAs they need
//   narrow  128 x 32: a quarter of the MMAs for the same bytes read (dA_e [r, in] as its transpose)
// Read on every call (benchmarks/tile_sweep.py times both); sets *narrow. Null on success, else a
// message naming the choices.
inline constexpr int64_t kNarrowRankColumns = 32;
inline const char* moe_rank_tile_narrow_for(const char* setting, bool* narrow) {
  return two_way_choice(setting, "wide", "narrow", "PYKERNELS_MOE_RANK_TILE must be wide (the default) or narrow",
                        narrow);
}

// ------------------------------------------------------------------ sort
// Stable counting sort of the assignments by expert; the same three outputs as the CPU op.
struct SortParams {
  const void* top_k_index;     // [slots] expert ids, int64 or int32
  bool index_is_int64;
  int64_t slots, experts;      // slots < 2^31
  int64_t* sorted_expert_idx;  // [slots]
  int64_t* sorted_token_idx;   // [slots]
  int64_t* expert_offsets;     // [experts + 1]
};
int64_t sort_workspace_bytes(const SortParams& p);
const char* launch_sort_tokens(const SortParams& p, void* workspace, cudaStream_t stream);

// ------------------------------------------------------------------ per-slot maps
// Any output may be null (not computed).
struct RoutingMapsParams {
  const int64_t* sorted_token_idx;  // [slots]
  const int64_t* expert_offsets;    // [experts + 1]
  int64_t slots, experts, top_k;
  int64_t* token_of_slot;           // [slots] sorted_token_idx[s] / top_k
  int64_t* slot_of_assignment;      // [slots] the inverse permutation, -1 for dropped assignments
  const void* gates;                // [slots] in assignment order (gates [T, k] flattened), or null
  DType gates_dtype;
  float* gate_of_slot;              // [slots] gates[sorted_token_idx[s]] in fp32
};
const char* launch_routing_maps(const RoutingMapsParams& p, cudaStream_t stream);

// ------------------------------------------------------------------ grouped GEMM operands
// A matrix read by slot: slot s reads row map[s] (row s without a map) of data, `cols` elements
// with row stride ld. Rows outside [0, rows) and columns >= cols read as zeros.
struct SlotRows {
  const void* data;
  int64_t ld, rows, cols;
  const int64_t* map;  // [slots] or null
};

// One matrix per expert: element (n, k) of expert e at data[e * expert_stride + n * ld_n + k * ld_k]
// with ld_k == 1 (K-major: weight [E, N, K]) or ld_n == 1 (N-major: weight [E, K, N]); k >= k_limit
// reads as zero.
struct ExpertMatrix {
  const void* data;
  int64_t expert_stride, ld_n, ld_k, k_limit;
};

// Row-grouped GEMM (forward, grad_x and the rank-r LoRA products): for every slot s of expert e
//   acc[s, n] = sum_k a[s, k] b_e[n, k] + sum_k a2[s, k] b2_e[n, k]     (n < n_cols, fp32)
//   out[out_map[s], n] = alpha * acc * gate_of_slot[s]                  (gate 1 without gates)
//   dgate_partial[tile_n, s] = sum over the tile's n of alpha * acc[s, n] * dot_rows[s, n]
// The first sum runs over a.cols, the second (LoRA as extra K-steps of the same accumulation) over
// a2.cols; a2.cols == 0 means no second product. Slots of the dropped bucket get zero rows. out
// null: no rows stored (only the gate gradient partials).
struct GroupedRowsParams {
  DType dtype;                    // of a, a2, b, b2, dot_rows and out
  int64_t slots, experts, n_cols;
  const int64_t* expert_offsets;  // [experts + 1]
  SlotRows a;
  ExpertMatrix b;
  SlotRows a2;
  ExpertMatrix b2;                // same major-ness as b
  float alpha;
  const float* gate_of_slot;      // [slots] or null
  void* out;                      // [out_rows, ld_out] or null
  int64_t ld_out, out_rows;
  const int64_t* out_map;         // [slots] or null
  float* dgate_partial;           // [grouped_rows_column_tiles(p), slots] or null
  SlotRows dot_rows;              // read when dgate_partial is set
  bool narrow_rank_tile;          // PYKERNELS_MOE_RANK_TILE=narrow: n_cols <= kNarrowRankColumns on 128 x 32
};
int64_t grouped_rows_column_tiles(const GroupedRowsParams& p);
int64_t grouped_rows_workspace_bytes(const GroupedRowsParams& p);
const char* launch_grouped_rows(const GroupedRowsParams& p, void* workspace, cudaStream_t stream);

// Slot-reduction GEMM (grad_weight and the LoRA factor gradients): for every expert e
//   out[e * expert_stride + m * ld_m + n * ld_n] = alpha * sum_{s of e} a[s, m] b[s, n]
// for m < m_rows, n < n_cols; experts without slots get zeros. One CTA sums a tile's whole K range
// in a fixed order: deterministic.
struct GroupedWeightGradParams {
  DType dtype;                    // of a, b and out
  int64_t slots, experts, m_rows, n_cols;
  const int64_t* expert_offsets;  // [experts + 1]
  SlotRows a, b;
  float alpha;
  void* out;
  int64_t expert_stride, ld_m, ld_n;
  bool narrow_rank_tile;          // PYKERNELS_MOE_RANK_TILE=narrow: m_rows or n_cols <= kNarrowRankColumns
};
const char* launch_grouped_weight_grad(const GroupedWeightGradParams& p, cudaStream_t stream);

// ------------------------------------------------------------------ small kernels
// out[t, c] = sum_j g_s rows[s, c] with s = slot_of_assignment[t * top_k + j] and g_s =
// gate_of_slot[s] (1 without gates), summed in fp32 in j order, rounded once; dropped assignments
// add nothing. rows [slots, cols], out [tokens, cols], both contiguous.
struct SumPerTokenParams {
  DType dtype;
  const void* rows;
  const int64_t* slot_of_assignment;  // [tokens * top_k]
  int64_t tokens, top_k, cols;
  void* out;
  const float* gate_of_slot;          // [slots] or null
};
const char* launch_sum_per_token(const SumPerTokenParams& p, cudaStream_t stream);

// out[s, c] = src[s, c] * gate_of_slot[s] for s < slots, c < src.cols (src read as in SlotRows);
// out [slots, ld_out]. Without gates a gather (or scatter through the inverse map). out may be src
// (in place) when src has no map.
struct ScaleRowsParams {
  DType dtype;
  int64_t slots;
  SlotRows src;
  const float* gate_of_slot;  // [slots], or null: gate 1
  void* out;
  int64_t ld_out;
};
const char* launch_scale_rows(const ScaleRowsParams& p, cudaStream_t stream);

// out[s, c] = 0 for c < cols and the slots of the dropped bucket (s >= expert_offsets[experts],
// clamped): the rows no expert's GEMM writes. out [slots, ld].
struct ZeroDroppedRowsParams {
  DType dtype;
  int64_t slots, experts;
  const int64_t* expert_offsets;  // [experts + 1]
  void* out;
  int64_t ld, cols;
};
const char* launch_zero_dropped_rows(const ZeroDroppedRowsParams& p, cudaStream_t stream);

// dots[s] = sum_c a[s, c] b[s, c] over c < a.cols, in fp32 (rows read as in SlotRows).
struct RowDotsParams {
  DType dtype;
  int64_t slots;
  SlotRows a, b;
  float* dots;  // [slots]
};
const char* launch_row_dots(const RowDotsParams& p, cudaStream_t stream);

// grad_gates[a] = sum_i dgate_partial[i, slot_of_assignment[a]] over column_tiles i in order, 0 for
// dropped assignments; stored in gates_dtype.
struct GateGradParams {
  const float* dgate_partial;  // [column_tiles, slots]
  int64_t column_tiles, slots;
  const int64_t* slot_of_assignment;
  void* grad_gates;            // [slots]
  DType gates_dtype;
};
const char* launch_gate_grad(const GateGradParams& p, cudaStream_t stream);

}  // namespace pykernels::moe
