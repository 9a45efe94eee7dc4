// CPU implementation of the grouped MoE ops (schemas in csrc/torch_bindings.cpp).
//
// moe_sort_tokens is a stable counting sort of the T*k assignments by expert. The grouped linear
// works expert by expert, threads taking whole experts (each writes only its own slots' rows, its
// own dW[e] and its own LoRA slices: no races, results independent of the thread count): gather
// the expert's rows, one GEMM (+ the LoRA pair), gate, write its rows in slot order. Assignment
// order and the per-token sum over k happen after, deterministically. GEMMs here are torch's on
// fp32 copies (fp64 stays fp64).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <vector>

#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;  // see lora_cpu.cpp

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
};

Problem make_problem(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                     const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                     bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     double scaling) {
  Problem p{check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 gates, lora_a, lora_b),
            x.contiguous(), weight.contiguous(), sorted_token_idx, {}, lora_a, lora_b, scaling, grouped_in,
            grouped_out, {}, compute_dtype(x)};
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

at::Tensor grouped_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                              const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                              bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                              const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                              double lora_scaling) {
  const Problem p = make_problem(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 grouped_out, gates, lora_a, lora_b, lora_scaling);
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
                    "grad_y must have shape (", grad_rows, ", ", p.size.out, "), got ", nf4::shape_string(grad_y.sizes()));
  compute_grad_gates = compute_grad_gates && gates.has_value();
  compute_grad_lora = compute_grad_lora && lora_a.has_value();
  const at::Tensor g = grad_y.contiguous();
  // Which row of grad_y each slot reads.
  const at::Tensor grad_row_of_slot = grouped_out ? at::arange(p.size.slots, sorted_token_idx.options())
                                      : summed    ? at::floor_divide(sorted_token_idx, top_k)
                                                  : sorted_token_idx;
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
