// Argument checks shared by the CPU and CUDA bindings of the fused token-logprob ops. Messages name
// the argument and say what was expected (raised as Python ValueError).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>

#include "common/torch_checks.h"

namespace pykernels::logprobs {

struct Sizes {
  int64_t n, h, v;
};

// hidden [N, H] and weight [V, H] in one float dtype, targets int64 [N], on one device, contiguous.
inline Sizes check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                          double temperature) {
  float_dtype(hidden.scalar_type(), "hidden");
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden must be 2-D [tokens, hidden_size], got ",
                    shape_string(hidden.sizes()));
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1), "weight must have shape (vocab_size, ",
                    hidden.size(1), ") to match hidden ", shape_string(hidden.sizes()), ", got ",
                    shape_string(weight.sizes()));
  TORCH_CHECK_VALUE(weight.size(0) >= 1, "weight must have at least one vocabulary row");
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), "weight must have hidden's dtype ",
                    hidden.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(targets.scalar_type() == at::kLong, "targets must be int64, got ", targets.scalar_type());
  TORCH_CHECK_VALUE(targets.dim() == 1 && targets.size(0) == hidden.size(0), "targets must have shape (",
                    hidden.size(0), ",) to match hidden, got ", shape_string(targets.sizes()));
  for (const auto* t : {&weight, &targets}) {
    TORCH_CHECK_VALUE(t->device() == hidden.device(), (t == &weight ? "weight" : "targets"), " must be on ",
                      hidden.device(), " like hidden, got ", t->device());
  }
  TORCH_CHECK_VALUE(hidden.is_contiguous() && weight.is_contiguous() && targets.is_contiguous(),
                    "hidden, weight and targets must be contiguous");
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0, "temperature must be a positive number, got ",
                    temperature);
  return {hidden.size(0), hidden.size(1), weight.size(0)};
}

inline void check_terms(int64_t hidden_grad_terms) {
  TORCH_CHECK_VALUE(hidden_grad_terms >= 0 && hidden_grad_terms <= 2,
                    "hidden_grad_terms must be 0 (none), 1 (logprob) or 2 (logprob and entropy), got ",
                    hidden_grad_terms);
}

// Per-token gradient inputs of the backward (fp32 [N], contiguous); grad_entropy may be absent.
inline void check_grad(const at::Tensor& g, const char* name, int64_t n, const at::Tensor& hidden) {
  TORCH_CHECK_VALUE(g.dim() == 1 && g.size(0) == n, name, " must have shape (", n, ",), got ",
                    shape_string(g.sizes()));
  TORCH_CHECK_VALUE(g.device() == hidden.device(), name, " must be on ", hidden.device(), ", got ", g.device());
}

// Checked, fp32, contiguous inputs of token_logprobs_backward. The incoming gradients are zeroed at
// ignored tokens here, so those rows get no gradient at all; a missing grad_entropy becomes zeros.
struct BackwardInputs {
  Sizes sizes;
  at::Tensor grad_logprob, grad_entropy, lse, entropy;
};

inline BackwardInputs check_backward_inputs(const at::Tensor& grad_logprobs,
                                            const std::optional<at::Tensor>& grad_entropy,
                                            const at::Tensor& hidden, const at::Tensor& weight,
                                            const at::Tensor& targets, const at::Tensor& lse,
                                            const at::Tensor& entropy, double temperature, int64_t ignore_index) {
  const Sizes s = check_inputs(hidden, weight, targets, temperature);
  check_grad(grad_logprobs, "grad_logprobs", s.n, hidden);
  check_grad(lse, "lse", s.n, hidden);
  check_grad(entropy, "entropy", s.n, hidden);
  if (grad_entropy.has_value()) check_grad(*grad_entropy, "grad_entropy", s.n, hidden);
  const at::Tensor keep = (targets != ignore_index).to(at::kFloat);
  const auto f32 = hidden.options().dtype(at::kFloat);
  return {s, (grad_logprobs.to(at::kFloat) * keep).contiguous(),
          grad_entropy.has_value() ? (grad_entropy->to(at::kFloat) * keep).contiguous() : at::zeros({s.n}, f32),
          lse.to(at::kFloat).contiguous(), entropy.to(at::kFloat).contiguous()};
}

}  // namespace pykernels::logprobs
