// CPU implementation of the grouped MoE ops (schemas in csrc/torch_bindings.cpp).
//
// moe_sort_tokens is a stable counting sort of the T*k assignments by expert. The grouped linear
// works expert by expert, threads taking whole experts (each writes only its own slots' rows, its
// own dW[e] and its own LoRA slices: no races, results independent of the thread count): gather
// the expert's rows, one GEMM (+ the LoRA pair), gate, write its rows in slot order. Assignment
// order and the per-token sum over k happen after, deterministically.
//
// bf16 forward on a CPU with AVX-512 BF16: work items of up to kSlotChunk slots of one expert;
// the slots' input rows are gathered straight into a packed GEMM operand, and the GEMM runs
// transposed, out^T = W_e x^T, so that W_e's rows stream through unpacked (read once per item,
// the dominant traffic at a few dozen tokens per expert); LoRA adds s B_e (A_e x^T) with the same
// micro-kernel; the epilogue gates, rounds and writes the slots' rows. Expert weights stored
// [E, in, out] (GPT-OSS' layout, passed as a transposed view) are read where they are, never copied:
// their forward packs W_e^T like the backward packs W_e (forward_n_major). The bf16 backward for
// frozen expert weights is described at backward_bf16. Everything else (other dtypes, CPUs without
// AVX-512 BF16, weight gradients) uses torch's GEMMs on fp32 copies.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_isa.h"
#include "common/cpu_memory.h"
#include "common/cpu_simd.h"
#include "moe/moe_cpu_kernels.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_tokens_cpu(const at::Tensor& top_k_index, int64_t num_experts) {
  check_top_k_index(top_k_index, num_experts);
  const at::Tensor flat = top_k_index.reshape(-1).to(at::kLong).contiguous();
  const int64_t slots = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<int64_t> next(num_experts + 2, 0);  // counts, then each bucket's next free slot
  for (int64_t a = 0; a < slots; ++a) {
    const int64_t e = id[a] >= 0 && id[a] < num_experts ? id[a] : num_experts;  // dropped: last bucket
    ++next[e + 1];
  }
  for (int64_t e = 0; e <= num_experts; ++e) next[e + 1] += next[e];
  at::Tensor offsets = at::from_blob(next.data(), {num_experts + 1}, at::kLong).clone();
  at::Tensor sorted_expert = at::empty({slots}, at::kLong), sorted_token = at::empty({slots}, at::kLong);
  int64_t* se = sorted_expert.data_ptr<int64_t>();
  int64_t* st = sorted_token.data_ptr<int64_t>();
  for (int64_t a = 0; a < slots; ++a) {
    const int64_t e = id[a] >= 0 && id[a] < num_experts ? id[a] : num_experts;
    const int64_t s = next[e]++;
    se[s] = e;
    st[s] = a;
  }
  return {sorted_expert, sorted_token, offsets};
}

at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

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

Problem make_problem(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                     const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                     bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     double scaling) {
  const bool n_major = !weight.is_contiguous() && weight.transpose(1, 2).is_contiguous();
  Problem p{check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 gates, lora_a, lora_b),
            x.contiguous(), n_major ? weight : weight.contiguous(), sorted_token_idx, {}, n_major, lora_a, lora_b,
            scaling, grouped_in, grouped_out, {}, compute_dtype(x)};
  check_routing_values(sorted_token_idx, expert_offsets);
  const int64_t* off = expert_offsets.data_ptr<int64_t>();
  p.offsets.assign(off, off + p.size.experts + 1);
  if (gates) p.gates_flat = gates->reshape(-1).to(p.compute);
  return p;
}

// Rows in slot order [slots, cols] -> the op's layout: slot order, assignment order, or summed per
// token. Dropped slots (past the last expert) hold zeros.
at::Tensor from_slot_order(const at::Tensor& by_slot, const Problem& p, bool grouped, bool sum_per_token) {
  if (grouped) return by_slot;
  at::Tensor by_assignment = at::zeros_like(by_slot).index_copy_(0, p.sorted_token_idx, by_slot);
  if (!sum_per_token) return by_assignment;
  return by_assignment.view({p.size.tokens, p.size.top_k, by_slot.size(1)}).sum(1);
}

bool use_bf16_kernels(const Problem& p) {
  return p.x.scalar_type() == at::kBFloat16 && active_cpu_isa() == CpuIsa::kAvx512 && gemm::has_bf16_gemm();
}

const uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// PEFT's expert-minor LoRA B [out, r * E] (B_e = columns e, e + E, ...) <-> [E, out, r] with B_e
// contiguous. Blocks of kBRows rows of B, expert by expert: each expert's [kBRows, r] slice is
// contiguous on the [E, out, r] side and the block's rows of B (kBRows x r x E) stay in L2, so
// neither side is walked with one element per cache line or one page per element (torch's
// permuted copies of the same took 2-6 ms each at Qwen3-30B-A3B shapes, a tenth of a LoRA
// backward).
constexpr int64_t kBRows = 16;

at::Tensor Problem::lora_b_by_expert() const {
  const int64_t out = size.out, rank = size.rank, experts = size.experts;
  const at::Tensor b = lora_b->contiguous();
  at::Tensor by_expert = at::empty({experts, out, rank}, b.options());
  const uint16_t* src = bf16_data(b);
  uint16_t* dst = reinterpret_cast<uint16_t*>(by_expert.data_ptr());
  at::parallel_for(0, (out + kBRows - 1) / kBRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * kBRows, o1 = std::min(out, b1 * kBRows);
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t q = 0; q < rank; ++q) dst[(e * out + o) * rank + q] = src[(o * rank + q) * experts + e];
      }
    }
  });
  return by_expert;
}

// The gradient of B back in PEFT's layout [out, r * E], rounded once to bf16, from fp32 [E, out, r].
at::Tensor lora_b_grad_from_experts(const at::Tensor& db_t, const Sizes& z) {
  at::Tensor grad = at::empty({z.out, z.rank * z.experts}, db_t.options().dtype(at::kBFloat16));
  const float* src = db_t.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(grad.data_ptr());
  at::parallel_for(0, (z.out + kBRows - 1) / kBRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * kBRows, o1 = std::min(z.out, b1 * kBRows);
    for (int64_t e = 0; e < z.experts; ++e) {
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t q = 0; q < z.rank; ++q) {
          dst[(o * z.rank + q) * z.experts + e] = round_to_bf16(src[(e * z.out + o) * z.rank + q]);
        }
      }
    }
  });
  return grad;
}

// out [T, cols] bf16 = each token's k slot rows (bf16 [slots, cols] in slot order) summed in
// fp32, in j order; dropped assignments add nothing.
void sum_per_token(const Problem& p, const uint16_t* slot_rows, int64_t cols, at::Tensor& out) {
  const Sizes& z = p.size;
  const int64_t* assignment = p.sorted_token_idx.data_ptr<int64_t>();
  std::vector<int64_t> slot_of(z.slots, -1);
  for (int64_t s = 0; s < p.offsets[z.experts]; ++s) slot_of[assignment[s]] = s;
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, z.tokens, 64, [&](int64_t t0, int64_t t1) {
    cpu::sum_slots_bf16(slot_rows, slot_of.data() + t0 * z.top_k, t1 - t0, z.top_k, cols, dst + t0 * cols);
  });
}

// Where the bf16 forward writes slot s's row: bf16 [out] at dst + dst_row[s] * out, times gates[s].
struct ForwardRows {
  uint16_t* dst;
  const int64_t* dst_row;  // [slots]
  const float* gates;      // [slots], or null: 1
};

// The forward for weights stored [E, out, in] (see the header of this file).
void forward_k_major(const Problem& p, const ForwardRows& out) {
  const Sizes& z = p.size;
  const int64_t* assignment = p.sorted_token_idx.data_ptr<int64_t>();
  // Work items: kSlotChunk slots of one expert x a group of output rows. With few experts
  // (Mixtral: 8) the rows are split too, so that the threads get several items each to balance.
  struct Item {
    int64_t e, s0, s1, o0, o1;
  };
  int64_t chunks = 0;
  for (int64_t e = 0; e < z.experts; ++e) chunks += (p.offsets[e + 1] - p.offsets[e] + kSlotChunk - 1) / kSlotChunk;
  const int64_t out_blocks = (z.out + kOutBlock - 1) / kOutBlock;
  const int64_t wanted = kItemsPerThread * at::get_num_threads();
  const int64_t groups = std::clamp<int64_t>((wanted + chunks - 1) / std::max<int64_t>(chunks, 1), 1, out_blocks);
  const int64_t group_rows = (out_blocks + groups - 1) / groups * kOutBlock;
  std::vector<Item> items;
  for (int64_t e = 0; e < z.experts; ++e) {
    for (int64_t s0 = p.offsets[e]; s0 < p.offsets[e + 1]; s0 += kSlotChunk) {
      for (int64_t o0 = 0; o0 < z.out; o0 += group_rows) {
        items.push_back({e, s0, std::min(s0 + kSlotChunk, p.offsets[e + 1]), o0, std::min(o0 + group_rows, z.out)});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {  // largest first
    return (a.s1 - a.s0) * (a.o1 - a.o0) > (b.s1 - b.s0) * (b.o1 - b.o0);
  });
  at::Tensor lora_a, lora_b_t;  // lora_b_t [E, out, r]
  if (p.lora_a) {
    lora_a = p.lora_a->contiguous();
    lora_b_t = p.lora_b_by_expert();
  }
  const uint16_t *x = bf16_data(p.x), *w = bf16_data(p.weight);
  const uint16_t* a = p.lora_a ? bf16_data(lora_a) : nullptr;
  const uint16_t* b = p.lora_a ? bf16_data(lora_b_t) : nullptr;
  const float scaling = static_cast<float>(p.scaling);
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local AlignedVector<uint32_t> packed_x, packed_u;
    thread_local AlignedVector<float> tile, u;
    thread_local AlignedVector<uint16_t> u_bf16;
    thread_local std::vector<int64_t> row_offsets;
    const Item& it = items[i];
    const int64_t m = it.s1 - it.s0, ld = round_up(m, gemm::kPanel);
    row_offsets.resize(m);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t slot = it.s0 + j;
      row_offsets[j] = (p.grouped_in ? slot : assignment[slot] / z.top_k) * z.in;
    }
    packed_x.resize(gemm::panels(m) * gemm::panel_stride(z.in));
    gemm::pack_transposed_gather(x, row_offsets.data(), m, z.in, packed_x.data());
    const int64_t r_pad = round_up(z.rank, 2);
    if (a != nullptr) {  // u^T = A_e x^T [r, m], scaled and rounded to bf16 like a bf16 LoRA's x A^T
      u.resize(z.rank * ld);
      gemm::gemm_bf16(z.rank, m, z.in, a + it.e * z.rank * z.in, z.in, packed_x.data(), gemm::panel_stride(z.in),
                      u.data(), ld, false);
      u_bf16.resize(z.rank * ld);
      for (int64_t q = 0; q < z.rank * ld; ++q) u_bf16[q] = round_to_bf16(scaling * u[q]);
      packed_u.resize(gemm::panels(m) * gemm::panel_stride(r_pad));
      gemm::pack_rows(u_bf16.data(), z.rank, r_pad, m, ld, packed_u.data());
    }
    const float* gates = out.gates ? out.gates + it.s0 : nullptr;
    for (int64_t o0 = it.o0; o0 < it.o1; o0 += kOutBlock) {
      const int64_t rows = std::min(kOutBlock, it.o1 - o0);
      tile.resize(rows * ld);
      gemm::gemm_bf16(rows, m, z.in, w + (it.e * z.out + o0) * z.in, z.in, packed_x.data(),
                      gemm::panel_stride(z.in), tile.data(), ld, false);
      if (a != nullptr) {  // + s B_e (A_e x^T)
        gemm::gemm_bf16(rows, m, z.rank, b + (it.e * z.out + o0) * z.rank, z.rank, packed_u.data(),
                        gemm::panel_stride(r_pad), tile.data(), ld, true);
      }
      cpu::store_transposed_bf16(tile.data(), ld, rows, m, gates, out.dst + o0, out.dst_row + it.s0, z.out);
    }
  });
}

// u_s = bf16(s x_s A_e^T) for every routed slot, rounded like a bf16 LoRA's x A^T: x_sorted the slots'
// input rows [valid, in], u [valid, r_pad] (the padding column zero). Experts split over the threads.
void lora_rows_bf16(const Problem& p, const uint16_t* x_sorted, uint16_t* u_out, int64_t r_pad) {
  const Sizes& z = p.size;
  const at::Tensor lora_a = p.lora_a->contiguous();
  at::parallel_for(0, z.experts, 1, [&](int64_t e0, int64_t e1) {
    thread_local AlignedVector<uint32_t> packed_at;
    thread_local AlignedVector<float> u;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t s0 = p.offsets[e], m = p.offsets[e + 1] - s0;
      if (m == 0) continue;
      packed_at.resize(gemm::panels(z.rank) * gemm::panel_stride(z.in));
      gemm::pack_transposed(bf16_data(lora_a) + e * z.rank * z.in, z.rank, z.in, z.in, packed_at.data());
      u.resize(m * z.rank);
      gemm::gemm_bf16(m, z.rank, z.in, x_sorted + s0 * z.in, z.in, packed_at.data(), gemm::panel_stride(z.in),
                      u.data(), z.rank, false);
      for (int64_t j = 0; j < m; ++j) {
        uint16_t* dst = u_out + (s0 + j) * r_pad;
        for (int64_t q = 0; q < z.rank; ++q) dst[q] = round_to_bf16(static_cast<float>(p.scaling) * u[j * z.rank + q]);
        if (r_pad > z.rank) dst[z.rank] = 0;
      }
    }
  });
}

// The forward for weights stored [E, in, out] (a transposed view): y = x W_e^T with the slots' rows
// of x (gathered once, in slot order) as the A operand and W_e^T, the stored [in, out] matrix, packed
// kColBlock columns at a time; work items (expert, column block) as in backward_bf16, so W is read
// once. LoRA's rank-r rows u = s x A_e^T (bf16, like the K-major forward's) are computed once per
// slot and add u B_e^T as r more K steps.
void forward_n_major(const Problem& p, const ForwardRows& out) {
  const Sizes& z = p.size;
  const int64_t valid = p.offsets[z.experts], k_pad = round_up(z.in, 2), r_pad = round_up(z.rank, 2);
  const int64_t* assignment = p.sorted_token_idx.data_ptr<int64_t>();
  const uint16_t *x = bf16_data(p.x), *w = bf16_data(p.weight);
  thread_local AlignedVector<uint16_t> x_workspace, u_workspace;  // x's rows [valid, in], u [valid, r_pad]
  x_workspace.resize(valid * z.in);
  uint16_t* x_sorted = x_workspace.data();
  at::parallel_for(0, valid, 64, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      std::copy_n(x + (p.grouped_in ? s : assignment[s] / z.top_k) * z.in, z.in, x_sorted + s * z.in);
    }
  });
  at::Tensor lora_b_t;  // [E, out, r]
  uint16_t* u_sorted = nullptr;  // the work items below run on other threads: they get the pointer, since
                                 // u_workspace named inside them would be each thread's own (empty) buffer
  if (p.lora_a) {
    lora_b_t = p.lora_b_by_expert();
    u_workspace.resize(valid * r_pad);
    u_sorted = u_workspace.data();
    lora_rows_bf16(p, x_sorted, u_sorted, r_pad);
  }
  struct Item {
    int64_t e, block;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < z.experts; ++e) {
    if (p.offsets[e + 1] == p.offsets[e]) continue;
    for (int64_t block = 0; block * kColBlock < z.out; ++block) items.push_back({e, block});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {  // most slots first
    return p.offsets[a.e + 1] - p.offsets[a.e] > p.offsets[b.e + 1] - p.offsets[b.e];
  });
  for_each_item(static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local AlignedVector<uint32_t> packed_w, packed_b;
    thread_local AlignedVector<float> c;
    const int64_t e = items[i].e, c0 = items[i].block * kColBlock, cols = std::min(kColBlock, z.out - c0);
    const int64_t ldc = gemm::padded_ld(cols);
    packed_w.resize(gemm::panels(cols) * gemm::panel_stride(k_pad));
    gemm::pack_rows(w + e * z.in * z.out + c0, z.in, k_pad, cols, z.out, packed_w.data());
    if (p.lora_a) {  // B_e^T [r, cols]: B_e's rows c0.. of lora_b_t[e]
      packed_b.resize(gemm::panels(cols) * gemm::panel_stride(z.rank));
      gemm::pack_transposed(bf16_data(lora_b_t) + (e * z.out + c0) * z.rank, cols, z.rank, z.rank, packed_b.data());
    }
    for (int64_t s0 = p.offsets[e]; s0 < p.offsets[e + 1]; s0 += kSlotChunk) {
      const int64_t m = std::min(kSlotChunk, p.offsets[e + 1] - s0);
      c.resize(m * ldc);
      gemm::gemm_bf16(m, cols, z.in, x_sorted + s0 * z.in, z.in, packed_w.data(), gemm::panel_stride(k_pad),
                      c.data(), ldc, false);
      if (p.lora_a) {
        gemm::gemm_bf16(m, cols, z.rank, u_sorted + s0 * r_pad, r_pad, packed_b.data(),
                        gemm::panel_stride(z.rank), c.data(), ldc, true);
      }
      cpu::gate_rows_bf16(c.data(), ldc, m, cols, out.gates ? out.gates + s0 : nullptr, nullptr, nullptr, nullptr,
                          out.dst + c0, out.dst_row + s0, z.out);
    }
  });
}

// The op's output in bf16. Each slot's row is written once, to its place in the output (slot or
// assignment order), or, when gated rows are summed per token, to a workspace kept across calls
// (fresh pages cost more than the sum on a VM) and then summed.
at::Tensor forward_bf16(const Problem& p) {
  const Sizes& z = p.size;
  const bool combine = p.gates_flat.defined() && !p.grouped_out;
  const int64_t* assignment = p.sorted_token_idx.data_ptr<int64_t>();
  const int64_t valid = p.offsets[z.experts];
  std::vector<int64_t> dst_row(z.slots);
  for (int64_t s = 0; s < z.slots; ++s) dst_row[s] = p.grouped_out || combine ? s : assignment[s];
  at::Tensor y = at::empty({combine ? z.tokens : z.slots, z.out}, p.x.options());
  thread_local AlignedVector<uint16_t> workspace;  // this calling thread's slot rows when combining
  if (combine) workspace.resize(z.slots * z.out);
  uint16_t* dst = combine ? workspace.data() : reinterpret_cast<uint16_t*>(y.data_ptr());
  if (!combine) {
    for (int64_t s = valid; s < z.slots; ++s) std::fill_n(dst + dst_row[s] * z.out, z.out, uint16_t{0});  // dropped
  }
  const at::Tensor gate_of_slot = p.gate_of_slot();
  const ForwardRows rows{dst, dst_row.data(), gate_of_slot.defined() ? gate_of_slot.data_ptr<float>() : nullptr};
  if (p.weight_n_major) {
    forward_n_major(p, rows);
  } else {
    forward_k_major(p, rows);
  }
  if (combine) sum_per_token(p, dst, z.out, y);
  return y;
}

at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                              const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                              bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                              const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                              double lora_scaling) {
  const Problem p = make_problem(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 grouped_out, gates, lora_a, lora_b, lora_scaling);
  if (use_bf16_kernels(p)) return forward_bf16(p);
  at::Tensor y = at::zeros({p.size.slots, p.size.out}, x.options().dtype(p.compute));
  at::parallel_for(0, p.size.experts, 1, [&](int64_t e0, int64_t e1) {
    const BelowAutograd below_autograd;
    for (int64_t e = e0; e < e1; ++e) {
      const ExpertSlots es = p.slots_of(e);
      if (es.s1 == es.s0) continue;
      const at::Tensor xe = p.rows(es);
      at::Tensor ye = at::mm(xe, p.w(e).t());
      if (p.lora_a) ye.add_(at::mm(at::mm(xe, p.a(e).t()), p.b(e).t()), p.scaling);
      if (p.gates_flat.defined()) ye.mul_(p.gate(es));
      y.narrow(0, es.s0, es.s1 - es.s0).copy_(ye);
    }
  });
  return from_slot_order(y, p, grouped_out, gates.has_value()).to(x.scalar_type());
}

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// One expert's LoRA terms in the bf16 backward, all on the micro-kernel with this thread's buffers
// (fresh per-expert fp32 temporaries cost more in page faults than their GEMMs at ~32 tokens):
//   v = dy_e B_e [m, r] in fp32, stored as bf16(s v) for its dx term (like the forward's u);
//   with gradients: dA_e = s (g v)^T x_e [r, in] and dB_e = s (g dy_e)^T u_e [out, r], u_e = x_e A_e^T,
// g the slots' gates, the rank-r operands rounded to bf16 as a bf16 LoRA's are. One thread per
// expert: its sums are deterministic.
struct LoraBackward {
  Sizes size;
  int64_t k_pad, r_pad;
  float scaling;
  const uint16_t* dy_sorted;  // [valid, k_pad]
  const uint16_t* x;
  const int64_t* x_offsets;   // per slot
  const float* gates;         // per slot, or null
  const uint16_t* lora_a;     // [E * r, in]
  const uint16_t* lora_b_t;   // [E, out, r]
  uint16_t* v_scaled;         // [valid, r_pad] out
  float* da;                  // [E * r, in] (zeros) or null: no gradients
  float* db_t;                // [E, out, r] (zeros)
};

void lora_backward_expert(const LoraBackward& l, int64_t e, int64_t s0, int64_t s1) {
  const Sizes& z = l.size;
  const int64_t m = s1 - s0, m_pad = round_up(m, 2), r = z.rank;
  if (m == 0) return;
  thread_local AlignedVector<uint32_t> packed_b, packed_x, packed_at, packed_u;
  thread_local AlignedVector<float> v, u;
  thread_local AlignedVector<uint16_t> x_rows, vg_t, dyg_t, u_bf16;
  const auto gate = [&](int64_t j) { return l.gates ? l.gates[s0 + j] : 1.0f; };
  // v = dy_e B_e
  packed_b.resize(gemm::panels(r) * gemm::panel_stride(l.k_pad));
  gemm::pack_rows(l.lora_b_t + e * z.out * r, z.out, l.k_pad, r, r, packed_b.data());
  v.resize(m * r);
  gemm::gemm_bf16(m, r, z.out, l.dy_sorted + s0 * l.k_pad, l.k_pad, packed_b.data(), gemm::panel_stride(l.k_pad),
                  v.data(), r, false);
  for (int64_t j = 0; j < m; ++j) {
    uint16_t* dst = l.v_scaled + (s0 + j) * l.r_pad;
    for (int64_t q = 0; q < r; ++q) dst[q] = round_to_bf16(l.scaling * v[j * r + q]);
    if (l.r_pad > r) dst[r] = 0;
  }
  if (l.da == nullptr) return;
  // The expert's input rows, contiguous, and packed as B [m, in] for dA.
  x_rows.resize(m * z.in);
  for (int64_t j = 0; j < m; ++j) std::copy_n(l.x + l.x_offsets[s0 + j], z.in, x_rows.data() + j * z.in);
  packed_x.resize(gemm::panels(z.in) * gemm::panel_stride(m_pad));
  gemm::pack_rows(x_rows.data(), m, m_pad, z.in, z.in, packed_x.data());
  // dA_e = (s g v)^T x_e
  vg_t.resize(r * m_pad);
  for (int64_t q = 0; q < r; ++q) {
    for (int64_t j = 0; j < m; ++j) vg_t[q * m_pad + j] = round_to_bf16(l.scaling * gate(j) * v[j * r + q]);
  }
  gemm::gemm_bf16(r, z.in, m, vg_t.data(), m_pad, packed_x.data(), gemm::panel_stride(m_pad), l.da + e * r * z.in,
                  z.in, false);
  // u_e = x_e A_e^T, then dB_e = (s g dy_e)^T u_e
  packed_at.resize(gemm::panels(r) * gemm::panel_stride(z.in));
  gemm::pack_transposed(l.lora_a + e * r * z.in, r, z.in, z.in, packed_at.data());
  u.resize(m * r);
  gemm::gemm_bf16(m, r, z.in, x_rows.data(), z.in, packed_at.data(), gemm::panel_stride(z.in), u.data(), r, false);
  u_bf16.resize(m * r);
  for (int64_t q = 0; q < m * r; ++q) u_bf16[q] = round_to_bf16(u[q]);
  packed_u.resize(gemm::panels(r) * gemm::panel_stride(m_pad));
  gemm::pack_rows(u_bf16.data(), m, m_pad, r, r, packed_u.data());
  dyg_t.resize(z.out * m_pad);
  for (int64_t j = 0; j < m; ++j) {
    const uint16_t* dy = l.dy_sorted + (s0 + j) * l.k_pad;
    const float scale = l.scaling * gate(j);
    for (int64_t o = 0; o < z.out; ++o) dyg_t[o * m_pad + j] = round_to_bf16(scale * bf16_to_float(dy[o]));
  }
  gemm::gemm_bf16(z.out, r, m, dyg_t.data(), m_pad, packed_u.data(), gemm::panel_stride(m_pad),
                  l.db_t + e * z.out * r, r, false);
}

// bf16 backward for frozen expert weights (grad_x, grad_gates, LoRA grads). dx = dy W_e runs on the
// micro-kernel with K = out, W's row index, so W_e must be packed: work items are (expert, block of
// kColBlock columns of dx), each packing its [out, kColBlock] slice of W_e into a buffer that stays
// in cache while every slot chunk of the expert runs against it. W is read from memory once, never
// written back packed, and small-E models (Mixtral: 8 experts) still split evenly over the threads.
// dy's rows in slot order (the GEMM's A operand) are gathered once for all items. The rank-r LoRA
// terms run on the micro-kernel too (lora_backward_expert); a gate's gradient is summed from
// per-column-block partial dots in a fixed order.
Grads backward_bf16(const Problem& p, const at::Tensor& g, const at::Tensor& grad_row_of_slot, bool compute_grad_x,
                    bool compute_grad_gates, bool compute_grad_lora) {
  const Sizes& z = p.size;
  const bool combine_x = !p.grouped_in;  // each token's k slot rows summed into its row of dx
  const int64_t* grad_row = grad_row_of_slot.data_ptr<int64_t>();
  const int64_t valid = p.offsets[z.experts];
  const int64_t k_pad = round_up(z.out, 2);
  at::Tensor dx = compute_grad_x ? at::empty({combine_x ? z.tokens : z.slots, z.in}, p.x.options()) : at::Tensor();
  // This calling thread's buffers, kept across calls (fresh pages are slow to fault in on a VM):
  // dx's slot rows before the per-token sum, and dy's rows in slot order [valid, k_pad].
  thread_local AlignedVector<uint16_t> dx_workspace, dy_workspace;
  uint16_t* dx_rows = nullptr;
  if (compute_grad_x) {
    if (combine_x) dx_workspace.resize(z.slots * z.in);
    dx_rows = combine_x ? dx_workspace.data() : reinterpret_cast<uint16_t*>(dx.data_ptr());
    if (!combine_x) dx.narrow(0, valid, z.slots - valid).zero_();
  }
  dy_workspace.resize(valid * k_pad);
  uint16_t* dy_sorted = dy_workspace.data();
  const uint16_t* gy = bf16_data(g);
  at::parallel_for(0, valid, 64, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      std::copy_n(gy + grad_row[s] * z.out, z.out, dy_sorted + s * k_pad);
      if (k_pad > z.out) dy_sorted[s * k_pad + z.out] = 0;
    }
  });
  const at::Tensor x_rows = p.grouped_in ? at::arange(valid, p.sorted_token_idx.options())
                                         : at::floor_divide(p.sorted_token_idx.narrow(0, 0, valid), z.top_k);
  std::vector<int64_t> x_offsets(valid);  // element offset of each slot's input row
  const int64_t* x_row = x_rows.data_ptr<int64_t>();
  for (int64_t s = 0; s < valid; ++s) x_offsets[s] = x_row[s] * z.in;
  const at::Tensor gate_of_slot = p.gate_of_slot();
  const float* gate_data = gate_of_slot.defined() ? gate_of_slot.data_ptr<float>() : nullptr;
  const auto f32 = p.x.options().dtype(at::kFloat);
  const uint16_t* x = bf16_data(p.x);

  // LoRA, per expert (lora_backward_expert): v = dy B_e and, when asked for, the factors'
  // gradients. v's term in dx, s v A_e, runs on the micro-kernel after dy W_e (r more K steps).
  const int64_t r_pad = round_up(z.rank, 2);
  thread_local AlignedVector<uint16_t> v_workspace;  // bf16(s v) [valid, r_pad]
  uint16_t* v_scaled = nullptr;
  at::Tensor lora_a_bf16, lora_b_t;
  at::Tensor da = compute_grad_lora ? at::zeros(p.lora_a->sizes(), f32) : at::Tensor();
  at::Tensor db_t = compute_grad_lora ? at::zeros({z.experts, z.out, z.rank}, f32) : at::Tensor();  // [E, out, r]
  if (p.lora_a) {
    v_workspace.resize(valid * r_pad);
    v_scaled = v_workspace.data();
    lora_a_bf16 = p.lora_a->contiguous();
    lora_b_t = p.lora_b_by_expert();  // B_e = lora_b_t[e] [out, r]
    const LoraBackward lora{z, k_pad, r_pad, static_cast<float>(p.scaling), dy_sorted, x, x_offsets.data(),
                            gate_data, bf16_data(lora_a_bf16), bf16_data(lora_b_t), v_scaled,
                            compute_grad_lora ? da.data_ptr<float>() : nullptr,
                            compute_grad_lora ? db_t.data_ptr<float>() : nullptr};
    at::parallel_for(0, z.experts, 1, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) lora_backward_expert(lora, e, p.offsets[e], p.offsets[e + 1]);
    });
  }

  // dx and the gates' gradients, by (expert, column block).
  const int64_t col_blocks = (z.in + kColBlock - 1) / kColBlock;
  struct Item {
    int64_t e, block;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < z.experts; ++e) {
    if (p.offsets[e + 1] == p.offsets[e]) continue;
    for (int64_t block = 0; block < col_blocks; ++block) items.push_back({e, block});
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {  // most slots first
    return p.offsets[a.e + 1] - p.offsets[a.e] > p.offsets[b.e + 1] - p.offsets[b.e];
  });
  std::vector<float> dgate_parts(compute_grad_gates ? col_blocks * valid : 0, 0.0f);  // [block][slot]
  const uint16_t* w = bf16_data(p.weight);
  std::vector<int64_t> stored_rows(kColBlock);  // weights stored [E, in, out]: element offset of row c of a block
  for (int64_t c = 0; c < kColBlock; ++c) stored_rows[c] = c * z.out;
  const uint16_t* a_bf16 = lora_a_bf16.defined() ? bf16_data(lora_a_bf16) : nullptr;
  if (compute_grad_x || compute_grad_gates) {
    for_each_item(static_cast<int64_t>(items.size()), [&](int64_t i) {
      const BelowAutograd below_autograd;
      thread_local AlignedVector<uint32_t> packed_w, packed_a;
      thread_local AlignedVector<float> c;
      thread_local AlignedVector<uint16_t> scratch;  // dx rows when only the gates' gradients are asked for
      thread_local std::vector<int64_t> dst_rows;
      const int64_t e = items[i].e, c0 = items[i].block * kColBlock, cols = std::min(kColBlock, z.in - c0);
      const int64_t ldc = gemm::padded_ld(cols);
      packed_w.resize(gemm::panels(cols) * gemm::panel_stride(k_pad));
      if (p.weight_n_major) {  // W_e [out, cols] from its transpose: the stored [in, out] rows c0..
        gemm::pack_transposed_gather(w + (e * z.in + c0) * z.out, stored_rows.data(), cols, z.out, packed_w.data());
      } else {
        gemm::pack_rows(w + e * z.out * z.in + c0, z.out, k_pad, cols, z.in, packed_w.data());
      }
      if (a_bf16 != nullptr) {
        packed_a.resize(gemm::panels(cols) * gemm::panel_stride(r_pad));
        gemm::pack_rows(a_bf16 + e * z.rank * z.in + c0, z.rank, r_pad, cols, z.in, packed_a.data());
      }
      for (int64_t s0 = p.offsets[e]; s0 < p.offsets[e + 1]; s0 += kSlotChunk) {
        const int64_t m = std::min(kSlotChunk, p.offsets[e + 1] - s0);
        c.resize(m * ldc);
        gemm::gemm_bf16(m, cols, z.out, dy_sorted + s0 * k_pad, k_pad, packed_w.data(), gemm::panel_stride(k_pad),
                        c.data(), ldc, false);  // dy W_e[:, c0:c0+cols]
        if (a_bf16 != nullptr) {  // + s (dy B_e) A_e[:, c0:c0+cols]
          gemm::gemm_bf16(m, cols, z.rank, v_scaled + s0 * r_pad, r_pad, packed_a.data(), gemm::panel_stride(r_pad),
                          c.data(), ldc, true);
        }
        dst_rows.resize(m);
        for (int64_t j = 0; j < m; ++j) dst_rows[j] = compute_grad_x ? s0 + j : j;
        if (!compute_grad_x) scratch.resize(m * cols);
        cpu::gate_rows_bf16(c.data(), ldc, m, cols, gate_data ? gate_data + s0 : nullptr, x + c0,
                            x_offsets.data() + s0,
                            compute_grad_gates ? dgate_parts.data() + items[i].block * valid + s0 : nullptr,
                            compute_grad_x ? dx_rows + c0 : scratch.data(), dst_rows.data(),
                            compute_grad_x ? z.in : cols);
      }
    });
  }
  if (compute_grad_x && combine_x) sum_per_token(p, dx_rows, z.in, dx);
  auto empty = [&](const at::Tensor& like) { return at::empty({0}, like.options()); };
  at::Tensor grad_gates = empty(p.x);
  if (compute_grad_gates) {
    at::Tensor by_slot = at::zeros({z.slots}, at::kFloat);
    float* dgate = by_slot.data_ptr<float>();
    for (int64_t block = 0; block < col_blocks; ++block) {  // fixed order: independent of the threads
      for (int64_t s = 0; s < valid; ++s) dgate[s] += dgate_parts[block * valid + s];
    }
    grad_gates = at::zeros({z.slots}, at::kFloat).index_copy_(0, p.sorted_token_idx, by_slot)
                     .view({z.tokens, z.top_k});  // fp32: the caller casts to gates' dtype
  }
  return {compute_grad_x ? dx : empty(p.x), empty(p.weight), grad_gates,
          compute_grad_lora ? da.to(p.lora_a->scalar_type()) : empty(p.x),
          compute_grad_lora ? lora_b_grad_from_experts(db_t, z) : empty(p.x)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
    const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in,
    bool grouped_out, const std::optional<at::Tensor>& gates, const std::optional<at::Tensor>& lora_a,
    const std::optional<at::Tensor>& lora_b, double lora_scaling, bool compute_grad_x, bool compute_grad_weight,
    bool compute_grad_gates, bool compute_grad_lora) {
  const Problem p = make_problem(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 grouped_out, gates, lora_a, lora_b, lora_scaling);
  const bool summed = gates.has_value() && !grouped_out;
  const int64_t grad_rows = summed ? p.size.tokens : p.size.slots;
  TORCH_CHECK_VALUE(grad_y.dim() == 2 && grad_y.size(0) == grad_rows && grad_y.size(1) == p.size.out,
                    "grad_y must have shape (", grad_rows, ", ", p.size.out, "), got ", shape_string(grad_y.sizes()));
  compute_grad_gates = compute_grad_gates && gates.has_value();
  compute_grad_lora = compute_grad_lora && lora_a.has_value();
  const at::Tensor g = grad_y.contiguous();
  // Which row of grad_y each slot reads.
  const at::Tensor grad_row_of_slot = grouped_out ? at::arange(p.size.slots, sorted_token_idx.options())
                                      : summed    ? at::floor_divide(sorted_token_idx, top_k)
                                                  : sorted_token_idx;
  if (use_bf16_kernels(p) && g.scalar_type() == at::kBFloat16 && !compute_grad_weight) {
    auto [grad_x, grad_weight, grad_gates, grad_a, grad_b] =
        backward_bf16(p, g, grad_row_of_slot, compute_grad_x, compute_grad_gates, compute_grad_lora);
    if (compute_grad_gates) grad_gates = grad_gates.to(gates->scalar_type());
    return {grad_x, grad_weight, grad_gates, grad_a, grad_b};
  }
  const auto opts = x.options().dtype(p.compute);
  at::Tensor dx = compute_grad_x ? at::zeros({p.size.slots, p.size.in}, opts) : at::Tensor();
  at::Tensor dgate = compute_grad_gates ? at::zeros({p.size.slots, 1}, opts) : at::Tensor();
  at::Tensor dw = compute_grad_weight ? at::zeros(weight.sizes(), opts) : at::Tensor();
  at::Tensor da = compute_grad_lora ? at::zeros(lora_a->sizes(), opts) : at::Tensor();
  at::Tensor db = compute_grad_lora ? at::zeros(lora_b->sizes(), opts) : at::Tensor();
  at::parallel_for(0, p.size.experts, 1, [&](int64_t e0, int64_t e1) {
    const BelowAutograd below_autograd;
    for (int64_t e = e0; e < e1; ++e) {
      const ExpertSlots es = p.slots_of(e);
      const int64_t m = es.s1 - es.s0;
      if (m == 0) continue;
      const at::Tensor ge = g.index_select(0, grad_row_of_slot.narrow(0, es.s0, m)).to(p.compute);  // d y_s
      const at::Tensor gate = p.gates_flat.defined() ? p.gate(es) : at::Tensor();
      const at::Tensor gated = gate.defined() ? ge * gate : ge;  // d (ungated y_s)
      const at::Tensor xe = p.rows(es);
      if (compute_grad_x || compute_grad_gates) {
        // d x_s without the gate: dy_s W_e (+ scaling (dy_s B_e) A_e); the gate's gradient is its dot with x_s.
        at::Tensor dxn = at::mm(ge, p.w(e));
        if (p.lora_a) dxn.add_(at::mm(at::mm(ge, p.b(e)), p.a(e)), p.scaling);
        if (compute_grad_gates) dgate.narrow(0, es.s0, m).copy_((dxn * xe).sum(1, true));
        if (compute_grad_x) dx.narrow(0, es.s0, m).copy_(gate.defined() ? dxn * gate : dxn);
      }
      if (compute_grad_weight) dw.select(0, e).copy_(at::mm(gated.t(), xe));
      if (compute_grad_lora) {
        const at::Tensor u = at::mm(xe, p.a(e).t());                          // [m, r]
        db.slice(1, e, p.size.rank * p.size.experts, p.size.experts).copy_(at::mm(gated.t(), u).mul_(p.scaling));
        da.narrow(0, e * p.size.rank, p.size.rank).copy_(at::mm(at::mm(gated, p.b(e)).t(), xe).mul_(p.scaling));
      }
    }
  });
  auto empty = [&](const at::Tensor& like) { return at::empty({0}, like.options()); };
  at::Tensor grad_x = compute_grad_x ? from_slot_order(dx, p, grouped_in, !grouped_in).to(x.scalar_type()) : empty(x);
  at::Tensor grad_gates = compute_grad_gates
                              ? from_slot_order(dgate, p, false, false).view({p.size.tokens, top_k}).to(gates->scalar_type())
                              : empty(x);
  return {grad_x, compute_grad_weight ? dw.to(weight.scalar_type()) : empty(weight), grad_gates,
          compute_grad_lora ? da.to(lora_a->scalar_type()) : empty(x),
          compute_grad_lora ? db.to(lora_b->scalar_type()) : empty(x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("moe_sort_tokens", &sort_tokens_cpu);
  m.impl("moe_grouped_linear", &grouped_linear_cpu);
  m.impl("moe_grouped_linear_backward", &grouped_linear_backward_cpu);
}

}  // namespace pykernels::moe
