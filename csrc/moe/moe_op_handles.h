// Typed dispatcher handles of the MoE ops (schemas in csrc/torch_bindings.cpp), for the C++ that calls
// them: their autograd (moe_autograd.cpp, below the Autograd key) and moe_gate_up_act's composition
// (gate_up_act_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "common/autograd_ops.h"

namespace pykernels::moe {

using autograd::find_op;
using autograd::OptionalTensor;

inline const auto& grouped_linear_op() {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, int64_t, bool, bool, const OptionalTensor&, const OptionalTensor&,
                         const OptionalTensor&, double)>("pykernels::moe_grouped_linear");
  return op;
}

using GroupedLinearGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline const auto& grouped_linear_backward_op() {
  static const auto op =
      find_op<GroupedLinearGrads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, int64_t, bool, bool, const OptionalTensor&,
                                 const OptionalTensor&, const OptionalTensor&, double, bool, bool, bool, bool)>(
          "pykernels::moe_grouped_linear_backward");
  return op;
}

inline const auto& gated_act_op() {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, int64_t, bool, double, double)>("pykernels::moe_gated_act");
  return op;
}

inline const auto& gated_act_backward_op() {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool, double, double, std::optional<bool>)>(
          "pykernels::moe_gated_act_backward");
  return op;
}

inline const auto& gate_up_act_op() {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool,
      const OptionalTensor&, const OptionalTensor&, double, int64_t, double, double)>("pykernels::moe_gate_up_act");
  return op;
}

}  // namespace pykernels::moe
