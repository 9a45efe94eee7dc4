// The CPU grouped linear's forward (op moe_grouped_linear; shared pieces in moe_cpu_grouped_linear.h).
//
// bf16 on a CPU with AVX-512 BF16: work items of up to kSlotChunk slots of one expert; the slots'
// input rows are gathered straight into a packed GEMM operand, and the GEMM runs transposed,
// out^T = W_e x^T, so that W_e's rows stream through unpacked (read once per item, the dominant
// traffic at a few dozen tokens per expert); LoRA adds s B_e (A_e x^T) with the same micro-kernel;
// the epilogue gates, rounds and writes the slots' rows. Expert weights stored [E, in, out] (GPT-OSS'
// layout, passed as a transposed view) are read where they are, never copied: their forward packs
// W_e^T like the backward packs W_e (forward_n_major). Elsewhere: torch's GEMMs on fp32 copies, expert
// by expert, or for an expert's few slots of bf16 a row of W_e at a time (rowwise_bf16).
#include "common/cpu_gemm_bf16.h"
#include "common/cpu_memory.h"
#include "common/cpu_simd.h"
#include "moe/moe_cpu_grouped_linear.h"
#include "moe/moe_cpu_kernels.h"

namespace pykernels::moe::cpu_op {
namespace {

// Where the bf16 forward writes slot s's row: bf16 [out] at dst + dst_row[s] * out, times gates[s].
struct ForwardRows {
  uint16_t* dst;
  const int64_t* dst_row;  // [slots]
  const float* gates;      // [slots], or null: 1
};

// The forward for weights stored [E, out, in] (see the top of this file).
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
// of x (gathered once, in slot order, and on AMX packed once for the tiles: PrepackedChunks) as the
// A operand and W_e^T, the stored [in, out] matrix, packed kColBlock columns at a time; work items
// (expert, column block) as in backward_bf16, so W is read once. LoRA's rank-r rows u = s x A_e^T
// (bf16, like the K-major forward's) are computed once per slot and add u B_e^T as r more K steps.
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
  thread_local AlignedVector<uint16_t> x_packed_workspace;
  const PrepackedChunks x_packed(p, x_sorted, z.in, z.in, x_packed_workspace);
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
      gemm::gemm_bf16(m, cols, z.in, x_sorted + s0 * z.in, z.in, x_packed.at(s0), packed_w.data(),
                      gemm::panel_stride(k_pad), c.data(), ldc, false);
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

// At most this many slots of an expert take rowwise_bf16 below.
constexpr int64_t kRowwiseSlots = 8;

// y = x W_e^T [m, out] fp32 for a few slots (x [m, in] fp32) and a bf16 W_e stored [out, in], a row of
// W_e at a time widened into an fp32 row that stays in L1. The fp32 path (at::mm on W_e.to(fp32))
// writes and reads back all of W_e widened for the couple of slots an expert gets at a few dozen
// tokens (Qwen3-30B-A3B's gate_up: 3.1M values, 12.6 MB); this reads W_e once, as stored. Sums run in
// kLanes interleaved fp32 partials (vectorizable without reassociating: -fno-fast-math), then in order.
at::Tensor rowwise_bf16(const at::Tensor& xe, const uint16_t* w, int64_t out) {
  constexpr int64_t kLanes = 16;
  const int64_t m = xe.size(0), in = xe.size(1);
  at::Tensor ye = at::empty({m, out}, xe.options());
  const float* x = xe.data_ptr<float>();
  float* y = ye.data_ptr<float>();
  thread_local AlignedVector<float> row;
  row.resize(in);
  for (int64_t o = 0; o < out; ++o) {
    const uint16_t* w_row = w + o * in;
    for (int64_t k = 0; k < in; ++k) row[k] = bf16_to_float(w_row[k]);
    for (int64_t j = 0; j < m; ++j) {
      const float* x_row = x + j * in;
      float partial[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= in; k += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) partial[l] += x_row[k + l] * row[k + l];
      }
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += partial[l];
      for (; k < in; ++k) sum += x_row[k] * row[k];
      y[j * out + o] = sum;
    }
  }
  return ye;
}

}  // namespace

at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                              const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                              bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                              const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                              double lora_scaling) {
  const Problem p = make_problem(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 grouped_out, gates, lora_a, lora_b, lora_scaling);
  if (use_bf16_kernels(p)) return forward_bf16(p);
  at::Tensor y = at::zeros({p.size.slots, p.size.out}, x.options().dtype(p.compute));
  const bool rowwise = p.x.scalar_type() == at::kBFloat16 && !p.weight_n_major;  // weight: x's dtype (checked)
  at::parallel_for(0, p.size.experts, 1, [&](int64_t e0, int64_t e1) {
    const BelowAutograd below_autograd;
    for (int64_t e = e0; e < e1; ++e) {
      const ExpertSlots es = p.slots_of(e);
      if (es.s1 == es.s0) continue;
      const at::Tensor xe = p.rows(es);
      at::Tensor ye = rowwise && es.s1 - es.s0 <= kRowwiseSlots
                          ? rowwise_bf16(xe, bf16_data(p.weight) + e * p.size.out * p.size.in, p.size.out)
                          : at::mm(xe, p.w(e).t());
      if (p.lora_a) ye.add_(at::mm(at::mm(xe, p.a(e).t()), p.b(e).t()), p.scaling);
      if (p.gates_flat.defined()) ye.mul_(p.gate(es));
      y.narrow(0, es.s0, es.s1 - es.s0).copy_(ye);
    }
  });
  return from_slot_order(y, p, grouped_out, gates.has_value()).to(x.scalar_type());
}

}  // namespace pykernels::moe::cpu_op
