// Fused token logprobs: shared declarations of the CUDA implementation (torch-free: included by .cu
// files that must compile against a CPU-only torch).
//
// logprobs_cuda_torch.cpp walks the vocabulary in chunks of rows of W and the tokens in chunks; each
// (token chunk, vocab chunk) logits tile z = h W_c^T / T comes from the CUTLASS GEMM of the LoRA
// family (gemm::launch_gemm, fp32 output, 1/T folded into alpha) and is reduced by the kernels
// below while later tiles reuse its buffer, so the [N, V] logits never exist.
#pragma once

#include <cstdint>

#include "common/dtype.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::logprobs {

// Per-token running statistics relative to the running max (see logprobs_cpu_kernels.h):
// max_z, sum_exp = sum exp(z - max_z), sum_exp_z = sum exp(z - max_z) (z - max_z); fp32 [N].
struct Stats {
  float* max_z;
  float* sum_exp;
  float* sum_exp_z;
};

// Folds the tile z [rows, cols] (row stride ld; row r is token t0 + r, column c is vocabulary
// entry v0 + c) into stats[t0 + r] and records z at the target (picked[t0 + r]) when the target
// falls in this chunk. One block per row.
struct FoldParams {
  const float* z;
  int64_t rows, cols, ld, t0, v0;
  const int64_t* targets;  // [N]
  Stats stats;
  float* picked;  // [N]
};
const char* launch_fold(const FoldParams& p, cudaStream_t stream);

// logprobs = picked - lse, entropy = log(sum_exp) - sum_exp_z / sum_exp, lse = max_z + log(sum_exp);
// logprobs and entropy 0 where targets == ignore_index. A target outside [0, vocab) that is not
// ignore_index gets a NaN logprob and, when bad_target is set, writes its index + 1 there (a
// host-mapped flag the next call reports: checking on the host first would cost a sync per call).
struct FinalizeParams {
  int64_t n;
  const int64_t* targets;
  int64_t ignore_index;
  int64_t vocab;
  int64_t* bad_target;  // [1] host-mapped, or null
  Stats stats;
  const float* picked;
  float* logprobs;
  float* entropy;
  float* lse;
};
const char* launch_finalize(const FinalizeParams& p, cudaStream_t stream);

// dz [rows, cols] (row stride ld_out, dz_dtype) = scale * dL/dz for the tile z [rows, cols] (row
// stride ld), with dL/dz = g_lp (onehot(target) - p) - g_ent p (z - lse + entropy), p = exp(z - lse).
// Per-token inputs are indexed by t0 + row; the gradients are already zero for ignored tokens.
struct GradParams {
  const float* z;
  int64_t rows, cols, ld, t0, v0;
  const int64_t* targets;
  const float* lse;
  const float* entropy;
  const float* grad_logprob;
  const float* grad_entropy;
  float scale;
  void* dz;
  int64_t ld_out;
  DType dz_dtype;
};
const char* launch_grad(const GradParams& p, cudaStream_t stream);

// The pieces around the Hopper GEMMs (logprobs_sm90.h), which never hold a logits tile:

// z_target[t] = scale * dot(hidden[t], weight[targets[t]]) in fp32 for every token whose target is
// a vocabulary entry (others 0): the picked logit of the forward, the target column's logit of the
// backward. One warp per token, 16-byte loads; bf16, h % 8 == 0, 16-byte aligned rows.
struct TargetLogitsParams {
  const void* hidden;  // bf16 [n, h]
  const void* weight;  // bf16 [vocab, h]
  int64_t n, h, vocab;
  const int64_t* targets;
  float scale;
  float* z_target;  // [n]
};
const char* launch_target_logits(const TargetLogitsParams& p, cudaStream_t stream);

// Folds the softmax partials of one (token chunk, vocab chunk), planes [tiles][rows_padded]
// (vocab_chunks.h: partial_index), into stats[t0 + row] in tile order. One thread per token.
struct FoldPartialsParams {
  const float* max_z;
  const float* sum_exp;
  const float* sum_exp_z;
  int64_t tokens, tiles, rows_padded, t0;
  Stats stats;
};
const char* launch_fold_partials(const FoldPartialsParams& p, cudaStream_t stream);

// Completes the dz tile the Hopper logit-grad GEMM wrote (everything but the target's + g_lp): for
// each token t0 + row whose target lies in [v0, v0 + cols), dz[row, target - v0] = scale dL/dz
// recomputed with the target term from z_target (grad_kernel's formula).
struct FixTargetGradsParams {
  int64_t rows, cols, t0, v0;
  const int64_t* targets;
  const float* z_target;
  const float* lse;
  const float* entropy;
  const float* grad_logprob;
  const float* grad_entropy;
  float scale;
  void* dz;  // bf16
  int64_t ld;
};
const char* launch_fix_target_grads(const FixTargetGradsParams& p, cudaStream_t stream);

}  // namespace pykernels::logprobs
