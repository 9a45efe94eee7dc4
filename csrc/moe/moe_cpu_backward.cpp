// The CPU grouped linear's backward (op moe_grouped_linear_backward; shared pieces in
// moe_cpu_grouped_linear.h): bf16 on the micro-kernel for frozen expert weights on a CPU with
// AVX-512 BF16 (backward_bf16), else torch's GEMMs expert by expert, weight gradients included.
#include "common/cpu_gemm_bf16.h"
#include "common/cpu_memory.h"
#include "common/cpu_simd.h"
#include "moe/moe_cpu_grouped_linear.h"
#include "moe/moe_cpu_kernels.h"

namespace pykernels::moe::cpu_op {
namespace {

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
// dy's rows in slot order (the GEMM's A operand) are gathered once for all items, and on AMX packed
// once for the tiles (PrepackedChunks). The rank-r LoRA terms run on the micro-kernel too
// (lora_backward_expert); a gate's gradient is summed from per-column-block partial dots in a fixed
// order.
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
    thread_local AlignedVector<uint16_t> dy_packed_workspace;
    const PrepackedChunks dy_packed(p, dy_sorted, k_pad, z.out, dy_packed_workspace);
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
        gemm::gemm_bf16(m, cols, z.out, dy_sorted + s0 * k_pad, k_pad, dy_packed.at(s0), packed_w.data(),
                        gemm::panel_stride(k_pad), c.data(), ldc, false);  // dy W_e[:, c0:c0+cols]
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

}  // namespace

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

}  // namespace pykernels::moe::cpu_op
