// Online softmax statistics (Milakov & Gimelshein, https://arxiv.org/abs/1805.02867), with the
// entropy term: a partial over a set of logits z is
//   max_z, sum_exp = sum exp(z - max_z), sum_exp_z = sum exp(z - max_z) (z - max_z).
// Partials over disjoint sets merge exactly (up to rounding) by re-basing both on the larger max.
// Every formula here holds for any reference in place of the max (lse = ref + log sum_exp, entropy
// = log sum_exp - sum_exp_z / sum_exp); add_logit with a slack keeps a reference up to `slack` below
// the max, so each exp is at most e^slack.
// An empty partial has sum_exp == 0 (and max_z == -inf, as the stats are initialised): it is never
// re-based through exp(-inf - -inf) = NaN but contributes zeros.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace pykernels {

struct SoftmaxPartial {
  float max_z, sum_exp, sum_exp_z;
};

// exp of a log-softmax argument: the fast intrinsic on the device (as the kernels always used),
// the C library's expf on the host.
PYKERNELS_HOST_DEVICE inline float softmax_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return std::exp(x);
#endif
}

// p re-expressed relative to new_max >= p.max_z: sums scaled by exp(p.max_z - new_max) and
// sum_exp_z shifted by (p.max_z - new_max) per unit of sum_exp. Empty partials stay empty.
PYKERNELS_HOST_DEVICE inline SoftmaxPartial rebase_partial(SoftmaxPartial p, float new_max) {
  const float alpha = p.sum_exp > 0.0f ? softmax_exp(p.max_z - new_max) : 0.0f;
  const float sum_exp_z = p.sum_exp > 0.0f ? alpha * (p.sum_exp_z + (p.max_z - new_max) * p.sum_exp) : 0.0f;
  return {new_max, alpha * p.sum_exp, sum_exp_z};
}

// Folds a chunk whose sums were already taken relative to new_max (>= the running max) into the
// running partial: the logprobs fold kernel's step.
PYKERNELS_HOST_DEVICE inline SoftmaxPartial fold_chunk(SoftmaxPartial running, float new_max, float chunk_sum_exp,
                                                       float chunk_sum_exp_z) {
  const SoftmaxPartial old = rebase_partial(running, new_max);
  return {new_max, old.sum_exp + chunk_sum_exp, old.sum_exp_z + chunk_sum_exp_z};
}

// The partial of the union of two disjoint sets.
PYKERNELS_HOST_DEVICE inline SoftmaxPartial merge_partials(SoftmaxPartial a, SoftmaxPartial b) {
  const float max_z = fmaxf(a.max_z, b.max_z);
  const SoftmaxPartial rebased_b = rebase_partial(b, max_z);
  return fold_chunk(a, max_z, rebased_b.sum_exp, rebased_b.sum_exp_z);
}

// The Hopper logprobs epilogue's lazy reference (PYKERNELS_SM90_LOGPROBS_FOLD=lazy_max): a row's
// reference moves only when a logit passes it by more than this. Each exp is then at most e^16 (9e6):
// a thread's 32 logits of a row sum to under 3e8, far inside fp32, with the same relative rounding.
inline constexpr float kLazyMaxSlack = 16.0f;

// p with one more logit z: one exp per logit (merge_partials(p, {z, 1, 0}) would take two). The
// step of the Hopper logprobs epilogue, which folds each logit of a tile as it leaves the GEMM.
// p is re-based on z when z passes its reference by more than `slack`: 0 keeps the running max (a
// re-base, one more exp, at each new max: in a warp whose lanes fold their own rows, ~20 of a row's
// first 32 logits are some lane's new max, and the warp runs both paths); kLazyMaxSlack re-bases
// about once per row (the first logit), the rest take the one-exp path together.
PYKERNELS_HOST_DEVICE inline SoftmaxPartial add_logit(SoftmaxPartial p, float z, float slack = 0.0f) {
  if (z > p.max_z + slack) {  // z is the new reference: it adds exp(0) = 1 and (z - z) = 0
    const SoftmaxPartial old = rebase_partial(p, z);
    return {z, old.sum_exp + 1.0f, old.sum_exp_z};
  }
  if (z == -INFINITY) return p;  // exp(-inf) adds 0, but (-inf) - max and 0 * -inf would be NaN
  const float d = z - p.max_z, e = softmax_exp(d);  // NaN z lands here and spreads, as in the tile path
  return {p.max_z, p.sum_exp + e, p.sum_exp_z + e * d};
}

// lse = max_z + log(sum_exp); entropy = -sum p log p = log(sum_exp) - sum_exp_z / sum_exp.
struct SoftmaxSummary {
  float lse, entropy;
};
PYKERNELS_HOST_DEVICE inline SoftmaxSummary summarize_partial(SoftmaxPartial p) {
  const float log_sum = logf(p.sum_exp);
  return {p.max_z + log_sum, log_sum - p.sum_exp_z / p.sum_exp};
}

}  // namespace pykernels
