// Autograd of lora_linear and lora_linear_nf4 (schemas in csrc/torch_bindings.cpp), registered for
// the Autograd key in C++ so that a LoRA layer's forward and backward run no Python between our
// two ops. Through torch.library.register_autograd (a Python autograd.Function, argument binding,
// the redispatch) a forward+backward cost ~60 us more on the CI host: 261 against 199 us for T 16 on
// a 64 x 64 weight, where eager PEFT-style torch takes 110 us; a model calls it seven times per
// transformer layer, and at a small model's shapes the GPU waits on that host time. The forward
// redispatches below Autograd to the CPU, CUDA or fake (torch.compile) implementation.
//
// Gradients: x, lora_A, lora_B, bias (sum of grad_y over rows) and x_lora (LoRA dropout's input);
// none for the frozen weight (the public function refuses one that requires grad) or for the NF4
// tensors. xa (fp32 x_lora A^T) is an output saved for backward and not differentiable.
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "common/autograd_ops.h"

namespace pykernels::lora {
namespace {

using namespace pykernels::autograd;  // find_op, OptionalEdges, needs_grad, present, the context
using Outputs = std::tuple<at::Tensor, at::Tensor>;                           // y, xa
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // x, x_lora, A, B

const auto& dense_forward_op() {
  static const auto op =
      find_op<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                      const OptionalTensor&, const OptionalTensor&)>("pykernels::lora_linear");
  return op;
}

const auto& dense_backward_op() {
  static const auto op =
      find_op<Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, double, const OptionalTensor&, bool)>("pykernels::lora_linear_backward");
  return op;
}

const auto& nf4_forward_op() {
  static const auto op =
      find_op<Outputs(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, c10::SymInt,
                      const at::Tensor&, const at::Tensor&, double, const OptionalTensor&, const OptionalTensor&,
                      const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, int64_t)>(
          "pykernels::lora_linear_nf4");
  return op;
}

const auto& nf4_backward_op() {
  static const auto op =
      find_op<Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const OptionalTensor&, bool,
                    const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, int64_t)>(
          "pykernels::lora_linear_nf4_backward");
  return op;
}

// The edges of the optional bias and x_lora, after the `first` required tensor inputs.
void save_edges(AutogradContext* ctx, int64_t first, const OptionalTensor& bias, const OptionalTensor& x_lora) {
  OptionalEdges edges(first);
  ctx->saved_data["bias_edge"] = edges.add(bias);
  ctx->saved_data["x_lora_edge"] = edges.add(x_lora);
}

// The gradients in forward-argument order: x at 0, A and B at a_index, a_index + 1, bias at
// bias_index, x_lora right after it; undefined for everything else (weight, NF4 tensors, scalars).
variable_list argument_grads(AutogradContext* ctx, const Grads& grads, const at::Tensor& grad_y, size_t count,
                             size_t a_index, size_t bias_index) {
  const int64_t bias_edge = ctx->saved_data["bias_edge"].toInt();
  const int64_t x_lora_edge = ctx->saved_data["x_lora_edge"].toInt();
  variable_list out(count);
  if (ctx->needs_input_grad(0)) out[0] = std::get<0>(grads);
  out[a_index] = std::get<2>(grads);
  out[a_index + 1] = std::get<3>(grads);
  if (needs_grad(ctx, bias_edge)) out[bias_index] = grad_y.sum(0);
  if (needs_grad(ctx, x_lora_edge)) out[bias_index + 1] = std::get<1>(grads);
  return out;
}

struct LoRALinear : public torch::autograd::Function<LoRALinear> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                               const OptionalTensor& bias, const OptionalTensor& x_lora) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, xa] = dense_forward_op().call(x, weight, lora_A, lora_B, scaling, bias, x_lora);
    ctx->save_for_backward({x, weight, lora_A, lora_B, xa, x_lora.value_or(at::Tensor())});
    ctx->saved_data["scaling"] = scaling;
    save_edges(ctx, 4, bias, x_lora);  // edges: x, weight, A, B, then bias, x_lora
    ctx->mark_non_differentiable({xa});
    return {y, xa};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor grad_y = grad_outputs[0].contiguous();
    const Grads grads = dense_backward_op().call(grad_y, saved[0], saved[1], saved[2], saved[3], saved[4],
                                                 ctx->saved_data["scaling"].toDouble(), present(saved[5]),
                                                 ctx->needs_input_grad(0));
    return argument_grads(ctx, grads, grad_y, /*count=*/7, /*a_index=*/2, /*bias_index=*/5);
  }
};

struct LoRALinearNF4 : public torch::autograd::Function<LoRALinearNF4> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& absmax, int64_t blocksize, c10::SymInt out_features,
                               const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                               const OptionalTensor& bias, const OptionalTensor& x_lora,
                               const OptionalTensor& nested_absmax, const OptionalTensor& nested_code,
                               const OptionalTensor& nested_offset, int64_t nested_blocksize) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, xa] = nf4_forward_op().call(x, packed, absmax, blocksize, std::move(out_features), lora_A, lora_B,
                                         scaling, bias, x_lora, nested_absmax, nested_code, nested_offset,
                                         nested_blocksize);
    ctx->save_for_backward({x, packed, absmax, lora_A, lora_B, xa, x_lora.value_or(at::Tensor()),
                            nested_absmax.value_or(at::Tensor()), nested_code.value_or(at::Tensor()),
                            nested_offset.value_or(at::Tensor())});
    ctx->saved_data["scaling"] = scaling;
    ctx->saved_data["blocksize"] = blocksize;
    ctx->saved_data["nested_blocksize"] = nested_blocksize;
    save_edges(ctx, 5, bias, x_lora);  // edges: x, packed, absmax, A, B, then bias, x_lora
    ctx->mark_non_differentiable({xa});
    return {y, xa};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor grad_y = grad_outputs[0].contiguous();
    const Grads grads = nf4_backward_op().call(
        grad_y, s[0], s[1], s[2], ctx->saved_data["blocksize"].toInt(), s[3], s[4], s[5],
        ctx->saved_data["scaling"].toDouble(), present(s[6]), ctx->needs_input_grad(0), present(s[7]),
        present(s[8]), present(s[9]), ctx->saved_data["nested_blocksize"].toInt());
    return argument_grads(ctx, grads, grad_y, /*count=*/14, /*a_index=*/5, /*bias_index=*/8);
  }
};

Outputs as_outputs(const variable_list& v) { return {v[0], v[1]}; }

Outputs lora_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
                             const at::Tensor& lora_B, double scaling, const OptionalTensor& bias,
                             const OptionalTensor& x_lora) {
  return as_outputs(LoRALinear::apply(x, weight, lora_A, lora_B, scaling, bias, x_lora));
}

Outputs lora_linear_nf4_autograd(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
                                 int64_t blocksize, c10::SymInt out_features, const at::Tensor& lora_A,
                                 const at::Tensor& lora_B, double scaling, const OptionalTensor& bias,
                                 const OptionalTensor& x_lora, const OptionalTensor& nested_absmax,
                                 const OptionalTensor& nested_code, const OptionalTensor& nested_offset,
                                 int64_t nested_blocksize) {
  return as_outputs(LoRALinearNF4::apply(x, packed, absmax, blocksize, std::move(out_features), lora_A, lora_B,
                                         scaling, bias, x_lora, nested_absmax, nested_code, nested_offset,
                                         nested_blocksize));
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, Autograd, m) {
  m.impl("lora_linear", &lora_linear_autograd);
  m.impl("lora_linear_nf4", &lora_linear_nf4_autograd);
}

}  // namespace pykernels::lora
