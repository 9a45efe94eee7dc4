// Autograd of moe_grouped_linear and moe_gated_act (schemas in csrc/torch_bindings.cpp), registered
// for the Autograd key in C++ like LoRA's (lora/lora_autograd.cpp, which says why): an MoE layer
// calls them three times per forward. experts_forward + backward at T 16 (4 experts, top 2, 64 x 32)
// on the CI host: 705 us through torch.library.register_autograd, 469 us here. The forward
// redispatches below Autograd to the CPU, CUDA or fake kernel; the backward calls the backward ops.
//
// moe_grouped_linear: gradients to x, weight, gates and the LoRA factors, each computed only when
// its input needs one; none for the routing tensors. moe_gated_act: gradient to gate_up.
// moe_gate_up_act: gradients to x, weight and the LoRA factors through both.
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "common/autograd_ops.h"
#include "moe/moe_op_handles.h"

namespace pykernels::moe {
namespace {

using namespace pykernels::autograd;  // find_op, OptionalEdges, needs_grad, present, the context

struct GroupedLinear : public torch::autograd::Function<GroupedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& sorted_expert_idx, const at::Tensor& sorted_token_idx,
                            const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in, bool grouped_out,
                            const OptionalTensor& gates, const OptionalTensor& lora_a, const OptionalTensor& lora_b,
                            double lora_scaling) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor y = grouped_linear_op().call(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                            grouped_in, grouped_out, gates, lora_a, lora_b, lora_scaling);
    ctx->save_for_backward({x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets,
                            gates.value_or(at::Tensor()), lora_a.value_or(at::Tensor()),
                            lora_b.value_or(at::Tensor())});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["grouped_in"] = grouped_in;
    ctx->saved_data["grouped_out"] = grouped_out;
    ctx->saved_data["lora_scaling"] = lora_scaling;
    OptionalEdges edges(5);  // edges: x, weight, the three routing tensors, then these
    ctx->saved_data["gates_edge"] = edges.add(gates);
    ctx->saved_data["lora_a_edge"] = edges.add(lora_a);
    ctx->saved_data["lora_b_edge"] = edges.add(lora_b);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
    const bool need_gates = needs_grad(ctx, ctx->saved_data["gates_edge"].toInt());
    const bool need_a = needs_grad(ctx, ctx->saved_data["lora_a_edge"].toInt());
    const bool need_b = needs_grad(ctx, ctx->saved_data["lora_b_edge"].toInt());
    auto [grad_x, grad_weight, grad_gates, grad_a, grad_b] = grouped_linear_backward_op().call(
        grad_outputs[0].contiguous(), s[0], s[1], s[2], s[3], s[4], ctx->saved_data["top_k"].toInt(),
        ctx->saved_data["grouped_in"].toBool(), ctx->saved_data["grouped_out"].toBool(), present(s[5]),
        present(s[6]), present(s[7]), ctx->saved_data["lora_scaling"].toDouble(), need_x, need_weight, need_gates,
        need_a || need_b);
    variable_list out(12);  // one per forward argument, in order
    if (need_x) out[0] = grad_x;
    if (need_weight) out[1] = grad_weight;
    if (need_gates) out[8] = grad_gates;
    if (need_a) out[9] = grad_a;
    if (need_b) out[10] = grad_b;
    return out;
  }
};

struct GatedAct : public torch::autograd::Function<GatedAct> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, int64_t act, bool interleaved,
                            double alpha, double limit) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor inner = gated_act_op().call(gate_up, act, interleaved, alpha, limit);
    ctx->save_for_backward({gate_up});
    ctx->saved_data["act"] = act;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    return inner;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor grad = gated_act_backward_op().call(
        grad_outputs[0].contiguous(), ctx->get_saved_variables()[0], ctx->saved_data["act"].toInt(),
        ctx->saved_data["interleaved"].toBool(), ctx->saved_data["alpha"].toDouble(),
        ctx->saved_data["limit"].toDouble(), std::nullopt);
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// moe_gate_up_act (moe/gate_up_act.h): the activation's gradient pass reads the paired pre-activation
// and writes its gradient in the weight's layout (gate rows, then up rows), which the gate_up
// projection's backward then takes as moe_grouped_linear's grad_y (grouped_out: slot order).
struct GateUpAct : public torch::autograd::Function<GateUpAct> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& sorted_expert_idx, const at::Tensor& sorted_token_idx,
                               const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in,
                               const OptionalTensor& lora_a, const OptionalTensor& lora_b, double lora_scaling,
                               int64_t act, double alpha, double limit) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [inner, gate_up] = gate_up_act_op().call(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets,
                                                  top_k, grouped_in, lora_a, lora_b, lora_scaling, act, alpha, limit);
    ctx->save_for_backward({x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets,
                            lora_a.value_or(at::Tensor()), lora_b.value_or(at::Tensor()), gate_up});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["grouped_in"] = grouped_in;
    ctx->saved_data["lora_scaling"] = lora_scaling;
    ctx->saved_data["act"] = act;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    OptionalEdges edges(5);  // edges: x, weight, the three routing tensors, then these
    ctx->saved_data["lora_a_edge"] = edges.add(lora_a);
    ctx->saved_data["lora_b_edge"] = edges.add(lora_b);
    ctx->mark_non_differentiable({gate_up});  // an output for the backward's sake, not a result
    return {inner, gate_up};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list out(13);  // one per forward argument, in order
    if (!grad_outputs[0].defined()) return out;
    const variable_list s = ctx->get_saved_variables();
    const bool need_x = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
    const bool need_a = needs_grad(ctx, ctx->saved_data["lora_a_edge"].toInt());
    const bool need_b = needs_grad(ctx, ctx->saved_data["lora_b_edge"].toInt());
    const at::Tensor grad_gate_up = gated_act_backward_op().call(
        grad_outputs[0].contiguous(), s[7], ctx->saved_data["act"].toInt(), /*interleaved=*/true,
        ctx->saved_data["alpha"].toDouble(), ctx->saved_data["limit"].toDouble(), /*grad_interleaved=*/false);
    auto [grad_x, grad_weight, grad_gates, grad_a, grad_b] = grouped_linear_backward_op().call(
        grad_gate_up, s[0], s[1], s[2], s[3], s[4], ctx->saved_data["top_k"].toInt(),
        ctx->saved_data["grouped_in"].toBool(), /*grouped_out=*/true, std::nullopt, present(s[5]), present(s[6]),
        ctx->saved_data["lora_scaling"].toDouble(), need_x, need_weight, false, need_a || need_b);
    if (need_x) out[0] = grad_x;
    if (need_weight) out[1] = grad_weight;
    if (need_a) out[7] = grad_a;
    if (need_b) out[8] = grad_b;
    return out;
  }
};

at::Tensor grouped_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                                   const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                                   bool grouped_in, bool grouped_out, const OptionalTensor& gates,
                                   const OptionalTensor& lora_a, const OptionalTensor& lora_b, double lora_scaling) {
  return GroupedLinear::apply(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                              grouped_out, gates, lora_a, lora_b, lora_scaling);
}

at::Tensor gated_act_autograd(const at::Tensor& gate_up, int64_t act, bool interleaved, double alpha, double limit) {
  return GatedAct::apply(gate_up, act, interleaved, alpha, limit);
}

std::tuple<at::Tensor, at::Tensor> gate_up_act_autograd(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& sorted_expert_idx,
                                                        const at::Tensor& sorted_token_idx,
                                                        const at::Tensor& expert_offsets, int64_t top_k,
                                                        bool grouped_in, const OptionalTensor& lora_a,
                                                        const OptionalTensor& lora_b, double lora_scaling, int64_t act,
                                                        double alpha, double limit) {
  const variable_list out = GateUpAct::apply(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                             grouped_in, lora_a, lora_b, lora_scaling, act, alpha, limit);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, Autograd, m) {
  m.impl("moe_grouped_linear", &grouped_linear_autograd);
  m.impl("moe_gated_act", &gated_act_autograd);
  m.impl("moe_gate_up_act", &gate_up_act_autograd);
}

}  // namespace pykernels::moe
