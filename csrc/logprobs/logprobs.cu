// CUDA kernels of the fused token logprobs (declarations and the math in logprobs.h): the
// reductions that run over each fp32 logits tile the GEMM leaves behind.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "common/online_softmax.h"
#include "logprobs/logit_grad.h"
#include "logprobs/logprobs.h"
#include "logprobs/vocab_chunks.h"

namespace pykernels::logprobs {
namespace {

constexpr int kThreads = 256;

// Block-wide reduction of one float per thread with op; every thread gets the result.
template <typename Op>
__device__ float block_reduce(float value, Op op, float* scratch /* [kThreads / 32] */) {
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) value = op(value, scratch[w]);
  return value;
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

__global__ void __launch_bounds__(kThreads) fold_kernel(FoldParams p) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x, token = p.t0 + row;
  const float* z = p.z + row * p.ld;
  float local_max = -INFINITY;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) local_max = fmaxf(local_max, z[c]);
  const float old_max = p.stats.max_z[token], old_sum = p.stats.sum_exp[token];
  const float new_max = fmaxf(old_max, block_reduce(local_max, Max{}, scratch));
  float sum = 0.0f, sum_z = 0.0f;
  for (int64_t c = threadIdx.x; c < p.cols; c += kThreads) {
    const float d = z[c] - new_max;
    const float e = __expf(d);
    sum += e;
    sum_z += e * d;
  }
  sum = block_reduce(sum, Sum{}, scratch);
  sum_z = block_reduce(sum_z, Sum{}, scratch);
  if (threadIdx.x == 0) {
    // Re-base the old sums on the new max (tokens with nothing folded yet have sum 0).
    const SoftmaxPartial folded = fold_chunk({old_max, old_sum, p.stats.sum_exp_z[token]}, new_max, sum, sum_z);
    p.stats.max_z[token] = folded.max_z;
    p.stats.sum_exp[token] = folded.sum_exp;
    p.stats.sum_exp_z[token] = folded.sum_exp_z;
    const int64_t column = target_column(p.targets[token], p.v0, p.cols);  // read only when inside this chunk
    if (column >= 0) p.picked[token] = z[column];
  }
}

__global__ void __launch_bounds__(kThreads) finalize_kernel(FinalizeParams p) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t >= p.n) return;
  const SoftmaxSummary summary = summarize_partial({p.stats.max_z[t], p.stats.sum_exp[t], p.stats.sum_exp_z[t]});
  const int64_t target = p.targets[t];
  const bool ignored = target == p.ignore_index;
  const bool bad = target_out_of_vocab(target, p.ignore_index, p.vocab);  // its logit was never picked
  if (bad && p.bad_target != nullptr) *reinterpret_cast<volatile int64_t*>(p.bad_target) = t + 1;
  p.lse[t] = summary.lse;
  p.logprobs[t] = ignored ? 0.0f : (bad ? __int_as_float(0x7fc00000) : p.picked[t] - summary.lse);
  p.entropy[t] = ignored ? 0.0f : summary.entropy;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grad_kernel(GradParams p) {
  const int64_t row = blockIdx.y, token = p.t0 + row;
  const float lse = p.lse[token], shift = p.entropy[token] - lse;
  const float g_lp = p.grad_logprob[token], g_ent = p.grad_entropy[token];
  const int64_t picked_column = target_column(p.targets[token], p.v0, p.cols);  // -1: not in this chunk
  const float* z = p.z + row * p.ld;
  T* out = static_cast<T*>(p.dz) + row * p.ld_out;
  for (int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x; c < p.cols; c += int64_t(gridDim.x) * kThreads) {
    out[c] = from_float<T>(p.scale * logit_grad(z[c], lse, shift, g_lp, g_ent, c == picked_column));
  }
}

// 8 bf16 (16 bytes) as floats.
__device__ __forceinline__ void load8(const __nv_bfloat16* at, float (&out)[8]) {
  const uint4 packed = *reinterpret_cast<const uint4*>(at);
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&packed);
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(v[i]);
}

constexpr int kWarpsPerBlock = kThreads / 32;

__global__ void __launch_bounds__(kThreads) target_logits_kernel(TargetLogitsParams p) {
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (t >= p.n) return;
  const int64_t target = p.targets[t];
  if (target < 0 || target >= p.vocab) {  // ignore_index or out of vocabulary: finalize decides
    if (lane == 0) p.z_target[t] = 0.0f;
    return;
  }
  const auto* h = static_cast<const __nv_bfloat16*>(p.hidden) + t * p.h;
  const auto* w = static_cast<const __nv_bfloat16*>(p.weight) + target * p.h;
  float sum = 0.0f;
  for (int64_t c = int64_t(lane) * 8; c < p.h; c += 32 * 8) {
    float hv[8], wv[8];
    load8(h + c, hv);
    load8(w + c, wv);
    for (int i = 0; i < 8; ++i) sum = fmaf(hv[i], wv[i], sum);
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) p.z_target[t] = p.scale * sum;
}

__global__ void __launch_bounds__(kThreads) fold_partials_kernel(FoldPartialsParams p) {
  const int64_t row = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= p.tokens) return;
  const int64_t token = p.t0 + row;
  SoftmaxPartial running{p.stats.max_z[token], p.stats.sum_exp[token], p.stats.sum_exp_z[token]};
  for (int64_t tile = 0; tile < p.tiles; ++tile) {
    const int64_t at = partial_index(row, tile, p.rows_padded);
    running = merge_partials(running, {p.max_z[at], p.sum_exp[at], p.sum_exp_z[at]});
  }
  p.stats.max_z[token] = running.max_z;
  p.stats.sum_exp[token] = running.sum_exp;
  p.stats.sum_exp_z[token] = running.sum_exp_z;
}

__global__ void __launch_bounds__(kThreads) fix_target_grads_kernel(FixTargetGradsParams p) {
  const int64_t row = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (row >= p.rows) return;
  const int64_t token = p.t0 + row;
  const int64_t column = target_column(p.targets[token], p.v0, p.cols);
  if (column < 0) return;
  const float lse = p.lse[token];
  const float dz = logit_grad(p.z_target[token], lse, p.entropy[token] - lse, p.grad_logprob[token],
                              p.grad_entropy[token], true);
  static_cast<__nv_bfloat16*>(p.dz)[row * p.ld + column] = __float2bfloat16_rn(p.scale * dz);
}

}  // namespace

const char* launch_fold(const FoldParams& p, cudaStream_t stream) {
  if (p.rows == 0) return nullptr;
  fold_kernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  return launch_status("logprobs fold kernel");
}

const char* launch_finalize(const FinalizeParams& p, cudaStream_t stream) {
  if (p.n == 0) return nullptr;
  finalize_kernel<<<static_cast<unsigned>((p.n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return launch_status("logprobs finalize kernel");
}

const char* launch_target_logits(const TargetLogitsParams& p, cudaStream_t stream) {
  if (p.n == 0) return nullptr;
  if (p.h % 8 != 0) return "logprobs target logits: the hidden size must be a multiple of 8";
  target_logits_kernel<<<static_cast<unsigned>((p.n + kWarpsPerBlock - 1) / kWarpsPerBlock), kThreads, 0, stream>>>(p);
  return launch_status("logprobs target logits kernel");
}

const char* launch_fold_partials(const FoldPartialsParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return nullptr;
  fold_partials_kernel<<<static_cast<unsigned>((p.tokens + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return launch_status("logprobs fold partials kernel");
}

const char* launch_fix_target_grads(const FixTargetGradsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return nullptr;
  fix_target_grads_kernel<<<static_cast<unsigned>((p.rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return launch_status("logprobs fix target grads kernel");
}

const char* launch_grad(const GradParams& p, cudaStream_t stream) {
  if (p.rows == 0) return nullptr;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((p.cols + kThreads - 1) / kThreads, 64)),
                  static_cast<unsigned>(p.rows));
  switch (p.dz_dtype) {
    case DType::kFloat32: grad_kernel<float><<<grid, kThreads, 0, stream>>>(p); break;
    case DType::kFloat16: grad_kernel<__half><<<grid, kThreads, 0, stream>>>(p); break;
    case DType::kBFloat16: grad_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p); break;
  }
  return launch_status("logprobs grad kernel");
}

}  // namespace pykernels::logprobs
