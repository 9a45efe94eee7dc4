// Shared by the ops' C++ autograd (csrc/*/*_autograd.cpp): the typed handle of an op in the
// dispatcher, and which inputs' gradients a backward must produce.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <cstdint>
#include <optional>

namespace pykernels::autograd {

using OptionalTensor = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A pykernels op by name ("pykernels::lora_linear"), called through the dispatcher: below the
// Autograd key (at::AutoDispatchBelowADInplaceOrView) it reaches the CPU, CUDA or fake kernel.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Graph edges of a custom Function are its tensor inputs that are present (an absent optional has
// none), so AutogradContext::needs_input_grad(edge) does not take the forward's argument index.
// OptionalEdges numbers the optional inputs from `first`, the edge after the required tensors.
class OptionalEdges {
 public:
  explicit OptionalEdges(int64_t first) : next_(first) {}
  int64_t add(const OptionalTensor& t) { return t.has_value() && t->defined() ? next_++ : -1; }  // -1: absent

 private:
  int64_t next_;
};

inline bool needs_grad(AutogradContext* ctx, int64_t edge) {
  return edge >= 0 && ctx->needs_input_grad(static_cast<size_t>(edge));
}

inline OptionalTensor present(const at::Tensor& saved) {
  return saved.defined() ? OptionalTensor(saved) : std::nullopt;
}

}  // namespace pykernels::autograd
