// Argument checks shared by the CPU and CUDA bindings of the grouped MoE ops. Messages name the
// argument and say what was expected (raised as Python ValueError).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "common/torch_checks.h"

namespace pykernels::moe {

inline void check_top_k_index(const at::Tensor& top_k_index, int64_t num_experts) {
  TORCH_CHECK_VALUE(top_k_index.dim() == 2, "top_k_index must be 2-D [tokens, top_k], got ",
                    shape_string(top_k_index.sizes()));
  TORCH_CHECK_VALUE(top_k_index.scalar_type() == at::kLong || top_k_index.scalar_type() == at::kInt,
                    "top_k_index must be int64 or int32, got ", top_k_index.scalar_type());
  TORCH_CHECK_VALUE(num_experts >= 1, "num_experts must be at least 1, got ", num_experts);
}

// The gated activation's gate_up [rows, 2 inner] (contiguous, a float dtype) and act code; returns inner.
inline int64_t check_gated_act(const at::Tensor& gate_up, int64_t act, int64_t act_count) {
  float_dtype(gate_up.scalar_type(), "gate_up");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
                    "gate_up must be 2-D [rows, 2 * intermediate] (gate and up columns), got ",
                    shape_string(gate_up.sizes()));
  TORCH_CHECK_VALUE(gate_up.is_contiguous(), "gate_up must be contiguous");
  TORCH_CHECK_VALUE(act >= 0 && act < act_count, "act must be a code in [0, ", act_count, "), got ", act);
  return gate_up.size(1) / 2;
}

inline void check_gated_act_grad(const at::Tensor& grad_inner, const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(grad_inner.dim() == 2 && grad_inner.size(0) == gate_up.size(0) &&
                        grad_inner.size(1) * 2 == gate_up.size(1),
                    "grad_inner must be [rows, intermediate] = ", shape_string({gate_up.size(0), gate_up.size(1) / 2}),
                    ", got ", shape_string(grad_inner.sizes()));
  TORCH_CHECK_VALUE(grad_inner.scalar_type() == gate_up.scalar_type(), "grad_inner must have gate_up's dtype ",
                    gate_up.scalar_type(), ", got ", grad_inner.scalar_type());
  TORCH_CHECK_VALUE(grad_inner.device() == gate_up.device(), "grad_inner must be on ", gate_up.device(),
                    " like gate_up, got ", grad_inner.device());
  TORCH_CHECK_VALUE(grad_inner.is_contiguous(), "grad_inner must be contiguous");
}

// Sizes of one grouped linear: E experts, `slots` = T * k assignments, weight [E, out, in].
struct Sizes {
  int64_t experts, out, in, slots, tokens, top_k, rank;
};

inline Sizes check_grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                                  const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                                  bool grouped_in, const std::optional<at::Tensor>& gates,
                                  const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b) {
  float_dtype(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [rows, in_features], got ", shape_string(x.sizes()));
  TORCH_CHECK_VALUE(weight.dim() == 3, "weight must be 3-D [num_experts, out_features, in_features], got ",
                    shape_string(weight.sizes()));
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype ", x.scalar_type(),
                    ", got ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.size(2) == x.size(1), "weight's in_features (dim 2) must match x's ", x.size(1),
                    ", got weight ", shape_string(weight.sizes()));
  TORCH_CHECK_VALUE(top_k >= 1, "top_k must be at least 1, got ", top_k);
  const int64_t experts = weight.size(0), slots = sorted_token_idx.numel();
  TORCH_CHECK_VALUE(experts >= 1, "weight must have at least one expert, got ", shape_string(weight.sizes()));
  for (const auto* t : {&sorted_expert_idx, &sorted_token_idx, &expert_offsets}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                      "sorted_expert_idx, sorted_token_idx and expert_offsets must be contiguous 1-D int64 "
                      "(from moe_sort_tokens), got ", t->scalar_type(), " ", shape_string(t->sizes()));
  }
  TORCH_CHECK_VALUE(sorted_expert_idx.numel() == slots, "sorted_expert_idx and sorted_token_idx must have the same "
                    "length, got ", sorted_expert_idx.numel(), " and ", slots);
  TORCH_CHECK_VALUE(expert_offsets.numel() == experts + 1, "expert_offsets must have num_experts + 1 = ",
                    experts + 1, " entries (weight has ", experts, " experts), got ", expert_offsets.numel());
  TORCH_CHECK_VALUE(slots % top_k == 0, "the number of assignments (", slots, ") must be a multiple of top_k (",
                    top_k, ")");
  const int64_t tokens = slots / top_k;
  TORCH_CHECK_VALUE(x.size(0) == (grouped_in ? slots : tokens), "x must have ", grouped_in ? slots : tokens,
                    grouped_in ? " rows (one per assignment, grouped_in)" : " rows (one per token)", ", got ",
                    shape_string(x.sizes()));
  if (gates) {
    float_dtype(gates->scalar_type(), "gates");
    TORCH_CHECK_VALUE(gates->numel() == slots && gates->dim() == 2 && gates->size(1) == top_k,
                      "gates must have shape (", tokens, ", ", top_k, "), got ", shape_string(gates->sizes()));
  }
  TORCH_CHECK_VALUE(lora_a.has_value() == lora_b.has_value(), "lora_a and lora_b must be given together");
  int64_t rank = 0;
  if (lora_a) {
    TORCH_CHECK_VALUE(lora_a->dim() == 2 && lora_a->size(1) == weight.size(2) && lora_a->size(0) % experts == 0 &&
                          lora_a->size(0) > 0,
                      "lora_a must have shape (r * ", experts, ", ", weight.size(2), ") (PEFT's expert-major layout), got ",
                      shape_string(lora_a->sizes()));
    rank = lora_a->size(0) / experts;
    TORCH_CHECK_VALUE(lora_b->dim() == 2 && lora_b->size(0) == weight.size(1) && lora_b->size(1) == rank * experts,
                      "lora_b must have shape (", weight.size(1), ", ", rank * experts,
                      ") (PEFT's expert-minor layout, r = ", rank, "), got ", shape_string(lora_b->sizes()));
    TORCH_CHECK_VALUE(lora_a->scalar_type() == x.scalar_type() && lora_b->scalar_type() == x.scalar_type(),
                      "lora_a and lora_b must have x's dtype ", x.scalar_type(), ", got ", lora_a->scalar_type(),
                      " and ", lora_b->scalar_type());
  }
  for (const at::Tensor* t : {&weight, &sorted_expert_idx, &sorted_token_idx, &expert_offsets}) {
    TORCH_CHECK_VALUE(t->device() == x.device(), "all tensors must be on x's device ", x.device(), ", got ",
                      t->device());
  }
  for (const auto* t : {&gates, &lora_a, &lora_b}) {
    TORCH_CHECK_VALUE(!t->has_value() || (*t)->device() == x.device(), "all tensors must be on x's device ",
                      x.device(), ", got ", (*t)->device());
  }
  return {experts, weight.size(1), weight.size(2), slots, tokens, top_k, rank};
}

// The routing tensors read on the host (CPU kernels): offsets non-decreasing within [0, slots],
// every slot's assignment in range.
inline void check_routing_values(const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets) {
  const int64_t* off = expert_offsets.data_ptr<int64_t>();
  const int64_t experts = expert_offsets.numel() - 1, slots = sorted_token_idx.numel();
  TORCH_CHECK_VALUE(off[0] == 0, "expert_offsets[0] must be 0, got ", off[0]);
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK_VALUE(off[e] <= off[e + 1] && off[e + 1] <= slots, "expert_offsets must be non-decreasing and at "
                      "most ", slots, ", got expert_offsets[", e, ":", e + 2, "] = ", off[e], ", ", off[e + 1]);
  }
  const int64_t* idx = sorted_token_idx.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK_VALUE(idx[s] >= 0 && idx[s] < slots, "sorted_token_idx[", s, "] = ", idx[s], " is outside [0, ",
                      slots, ")");
  }
}

}  // namespace pykernels::moe
