// moe_gate_up_act as the composition of two ops (moe/gate_up_act.h): the CPU kernel and the CUDA
// kernel's fallback.
#include "moe/gate_up_act.h"

#include <torch/library.h>

#include "moe/moe_op_handles.h"

namespace pykernels::moe {

void check_gate_up_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.size(1) % 2 == 0,
                    "moe_gate_up_act: weight must be [experts, 2 * intermediate, in_features] (gate rows, then up "
                    "rows), got shape ",
                    weight.sizes());
}

std::tuple<at::Tensor, at::Tensor> gate_up_act_composed(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& sorted_expert_idx,
                                                        const at::Tensor& sorted_token_idx,
                                                        const at::Tensor& expert_offsets, int64_t top_k,
                                                        bool grouped_in, const std::optional<at::Tensor>& lora_a,
                                                        const std::optional<at::Tensor>& lora_b, double lora_scaling,
                                                        int64_t act, double alpha, double limit) {
  check_gate_up_weight(weight);
  const at::Tensor rows = grouped_linear_op().call(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets,
                                                   top_k, grouped_in, /*grouped_out=*/true, std::nullopt, lora_a,
                                                   lora_b, lora_scaling);
  const int64_t slots = rows.size(0), inner = rows.size(1) / 2;
  const at::Tensor paired = rows.view({slots, 2, inner}).transpose(1, 2).reshape({slots, 2 * inner});
  return {gated_act_op().call(paired, act, /*interleaved=*/true, alpha, limit), paired};
}

TORCH_LIBRARY_IMPL(pykernels, CPU, m) { m.impl("moe_gate_up_act", &gate_up_act_composed); }

}  // namespace pykernels::moe
