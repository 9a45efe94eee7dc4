// The op moe_gate_up_act (schema in csrc/torch_bindings.cpp): an expert MLP's gate_up projection and
// its gated activation in one call, so the Hopper core can run both as one GEMM (the gated GEMM,
// common/paired_rows.h and moe/gated_act_visitor_sm90.cuh: D in paired columns, act(gate) * up in the
// epilogue). Its outputs: inner [slots, I] and the pre-activation [slots, 2I] in paired order (gate_j,
// up_j in columns 2j, 2j + 1), which its backward (moe_autograd.cpp) turns back into the weight's
// layout in the activation's gradient pass (moe_gated_act_backward, grad_interleaved=False).
//
// gate_up_act_composed is the op everywhere else: moe_grouped_linear's slot rows, their columns
// paired (a copy), moe_gated_act on them. It registers as the CPU kernel and is the CUDA kernel's
// fallback (moe_cuda_torch.cpp) where the gated GEMM does not apply.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace pykernels::moe {

std::tuple<at::Tensor, at::Tensor> gate_up_act_composed(const at::Tensor& x, const at::Tensor& weight,
                                                        const at::Tensor& sorted_expert_idx,
                                                        const at::Tensor& sorted_token_idx,
                                                        const at::Tensor& expert_offsets, int64_t top_k,
                                                        bool grouped_in, const std::optional<at::Tensor>& lora_a,
                                                        const std::optional<at::Tensor>& lora_b, double lora_scaling,
                                                        int64_t act, double alpha, double limit);

// What the op asks of weight beyond moe_grouped_linear's checks: a 3-D [E, 2I, in] tensor.
void check_gate_up_weight(const at::Tensor& weight);

}  // namespace pykernels::moe
