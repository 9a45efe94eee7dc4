// The CPU grouped linear (ops moe_grouped_linear and its backward; moe_cpu.cpp registers them): what
// its forward (moe_cpu_forward.cpp) and backward (moe_cpu_backward.cpp) share. A call's Problem
// (inputs checked, expert offsets on the host, per-expert views in the compute dtype), the moves
// between slot order and the op's layouts, LoRA B's expert-major copy, and the work split.
//
// Experts are independent: threads take whole experts or (expert, block) items, and each item writes
// only its own slots' rows, its own dW[e] and its own LoRA slices: no races, results independent of
// the thread count. Assignment order and the per-token sum over k happen after, deterministically.
// The bf16 kernels (CPUs with AVX-512 BF16) are described in the two files; everything else (other
// dtypes, other CPUs, weight gradients) uses torch's GEMMs on fp32 copies.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "common/cpu_memory.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe::cpu_op {

using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;  // see lora_cpu.cpp

constexpr int64_t kSlotChunk = 256;  // slots per work item (packed x: kSlotChunk x in bf16)
constexpr int64_t kOutBlock = 512;   // rows of W_e per GEMM call: its A block (512 x 512 bf16) stays in L2
constexpr int64_t kColBlock = 128;   // output columns per work item where W_e is the packed B operand
                                     // (the backward's dx; the forward of weights stored [E, in, out])
constexpr int64_t kItemsPerThread = 8;  // forward: split output rows until each thread has this many items

// fn(i) for i in [0, n), items claimed one at a time by the threads (a shared counter): items of
// uneven cost, ordered largest first, balance dynamically. Each item writes its own outputs, so
// results do not depend on which thread ran what.
template <typename Fn>
void for_each_item(int64_t n, const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One expert's slots [s0, s1) and the rows they read.
struct ExpertSlots {
  int64_t e, s0, s1;
  at::Tensor assignment;  // sorted_token_idx[s0:s1]
  at::Tensor input_rows;  // row of x per slot: the slot itself (grouped_in) or its token
};

// Everything one call needs, shared by forward and backward.
struct Problem {
  Sizes size;
  at::Tensor x, weight, sorted_token_idx, gates_flat;  // gates_flat: [T*k] in compute dtype, or undefined
  bool weight_n_major;  // weight [E, out, in] is a transposed view of a contiguous [E, in, out] tensor
  std::optional<at::Tensor> lora_a, lora_b;
  double scaling;
  bool grouped_in, grouped_out;
  std::vector<int64_t> offsets;
  at::ScalarType compute;

  ExpertSlots slots_of(int64_t e) const {
    ExpertSlots es{e, offsets[e], offsets[e + 1], {}, {}};
    es.assignment = sorted_token_idx.narrow(0, es.s0, es.s1 - es.s0);
    es.input_rows = grouped_in ? at::arange(es.s0, es.s1, sorted_token_idx.options())
                               : at::floor_divide(es.assignment, size.top_k);
    return es;
  }
  at::Tensor rows(const ExpertSlots& es) const { return x.index_select(0, es.input_rows).to(compute); }
  at::Tensor w(int64_t e) const { return weight.select(0, e).to(compute); }
  at::Tensor a(int64_t e) const { return lora_a->narrow(0, e * size.rank, size.rank).to(compute); }
  at::Tensor b(int64_t e) const {
    return lora_b->slice(1, e, size.rank * size.experts, size.experts).to(compute);  // columns e, e + E, ...
  }
  at::Tensor gate(const ExpertSlots& es) const { return gates_flat.index_select(0, es.assignment).unsqueeze(1); }
  // The routing gate of every slot, in slot order; undefined without gates.
  at::Tensor gate_of_slot() const {
    return gates_flat.defined() ? gates_flat.index_select(0, sorted_token_idx).contiguous() : at::Tensor();
  }
  // LoRA B (bf16) as [E, out, r] with each B_e contiguous (PEFT's columns e, e + E, ...).
  at::Tensor lora_b_by_expert() const;
};

// The call's Problem, inputs checked (check_grouped_linear, check_routing_values).
Problem make_problem(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                     const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                     bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     double scaling);

// Rows in slot order [slots, cols] -> the op's layout: slot order, assignment order, or summed per
// token. Dropped slots (past the last expert) hold zeros.
at::Tensor from_slot_order(const at::Tensor& by_slot, const Problem& p, bool grouped, bool sum_per_token);

bool use_bf16_kernels(const Problem& p);

inline const uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// The gradient of B back in PEFT's layout [out, r * E], rounded once to bf16, from fp32 [E, out, r].
at::Tensor lora_b_grad_from_experts(const at::Tensor& db_t, const Sizes& z);

// out [T, cols] bf16 = each token's k slot rows (bf16 [slots, cols] in slot order) summed in
// fp32, in j order; dropped assignments add nothing.
void sum_per_token(const Problem& p, const uint16_t* slot_rows, int64_t cols, at::Tensor& out);

// The slot chunks' rows (rows [valid, k] with row stride ld, in slot order; each expert's slots in
// chunks of kSlotChunk) copied once into the order the GEMM's AMX tiles read them (gemm::prepack_a):
// the work items (expert, column block) each multiply one chunk by their block of the weight, and
// gemm_bf16 would copy the chunk again for every block (on Mixtral's shapes as many bytes as the
// weight blocks themselves). Nothing is packed where the tiles do not run. workspace: the calling
// thread's, kept across calls.
class PrepackedChunks {
 public:
  PrepackedChunks(const Problem& p, const uint16_t* rows, int64_t ld, int64_t k, AlignedVector<uint16_t>& workspace);
  // The chunk that starts at slot s0, or null: gemm_bf16 packs it itself.
  const uint16_t* at(int64_t s0) const { return offset_[s0] < 0 ? nullptr : data_ + offset_[s0]; }

 private:
  std::vector<int64_t> offset_;  // per slot: element offset of the chunk starting there, else -1
  const uint16_t* data_ = nullptr;
};

// The ops (schemas in csrc/torch_bindings.cpp).
at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                              const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                              bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                              const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                              double lora_scaling);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
    const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in,
    bool grouped_out, const std::optional<at::Tensor>& gates, const std::optional<at::Tensor>& lora_a,
    const std::optional<at::Tensor>& lora_b, double lora_scaling, bool compute_grad_x, bool compute_grad_weight,
    bool compute_grad_gates, bool compute_grad_lora);

}  // namespace pykernels::moe::cpu_op
