// CUDA binding of the gated activation ops (the math: moe/gated_act.h; the kernel in
// moe_routing.cu): checks shared with the CPU, allocation on the input's device, torch's stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "moe/gated_act.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

at::Tensor run(const at::Tensor& gate_up, const at::Tensor* grad_inner, int64_t act, bool interleaved, double alpha,
               double limit, bool grad_interleaved) {
  const int64_t inner = check_gated_act(gate_up, act, kGatedActCount);
  if (grad_inner != nullptr) check_gated_act_grad(*grad_inner, gate_up);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  at::Tensor out =
      grad_inner != nullptr ? at::empty_like(gate_up) : at::empty({gate_up.size(0), inner}, gate_up.options());
  const GatedActParams p{float_dtype(gate_up.scalar_type(), "gate_up"),
                         {static_cast<GatedAct>(act), static_cast<float>(alpha), static_cast<float>(limit)},
                         interleaved,
                         gate_up.size(0),
                         inner,
                         gate_up.data_ptr(),
                         grad_inner != nullptr ? grad_inner->data_ptr() : nullptr,
                         out.data_ptr(),
                         grad_interleaved};
  const char* error = launch_gated_act(p, c10::cuda::getCurrentCUDAStream(gate_up.device().index()).stream());
  TORCH_CHECK(error == nullptr, error);
  return out;
}

at::Tensor gated_act_cuda(const at::Tensor& gate_up, int64_t act, bool interleaved, double alpha, double limit) {
  return run(gate_up, nullptr, act, interleaved, alpha, limit, interleaved);
}

at::Tensor gated_act_backward_cuda(const at::Tensor& grad_inner, const at::Tensor& gate_up, int64_t act,
                                   bool interleaved, double alpha, double limit, std::optional<bool> grad_interleaved) {
  return run(gate_up, &grad_inner, act, interleaved, alpha, limit, grad_interleaved.value_or(interleaved));
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("moe_gated_act", &gated_act_cuda);
  m.impl("moe_gated_act_backward", &gated_act_backward_cuda);
}

}  // namespace pykernels::moe
