// dL/dz for one logit of the fused token logprobs, shared by the sm80 grad kernel, the Hopper
// logit-grad epilogue and the target fix-up (logprobs.cu, logprobs_sm90.cu), and host-tested
// against autograd (tests/test_device_logic_host.py). With p = exp(z - lse), L = g_lp logprob +
// g_ent entropy:
//   dL/dz = g_lp (onehot(target) - p) - g_ent p (z - lse + entropy)
// shift = entropy - lse per token. Without the target term (target == false) it is what every
// column but the target's gets.
#pragma once

#include "common/host_device.h"
#include "common/online_softmax.h"

namespace pykernels::logprobs {

PYKERNELS_HOST_DEVICE inline float logit_grad(float z, float lse, float shift, float g_lp, float g_ent, bool target) {
  const float p = softmax_exp(z - lse);
  const float dz = -p * (g_lp + g_ent * (z + shift));
  return target ? dz + g_lp : dz;
}

}  // namespace pykernels::logprobs
