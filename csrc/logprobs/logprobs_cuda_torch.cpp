// CUDA implementation of the fused token-logprob ops (schemas in csrc/torch_bindings.cpp; the same
// results as logprobs_cpu.cpp up to rounding): checks, chunking and the composition of the CUTLASS
// GEMM (gemm::run_gemm: the sm_90a core on Hopper for bf16, else gemm::launch_gemm) with the
// reduction kernels of logprobs.cu on torch's current stream.
//
//   forward   for each vocab chunk W_c, token chunk h_t:  z = h_t W_c^T / T   (fp32 tile)
//                                                         fold z into per-token running stats
//             finalize: logprobs, entropy, lse
//             Hopper (bf16, logprobs_sm90.h): the GEMM's epilogue folds z in registers and leaves
//             one softmax partial per (token, 128-entry vocab tile); a small pass folds those into
//             the running stats; the target logits come from one dot per token. No z tile.
//   backward  for each vocab chunk W_c:  dW_c = 0 (fp32)
//               for each token chunk:   z = h_t W_c^T / T, dz = scale dL/dz (input dtype)
//                                       dh_t += dz W_c          (fp32, C = D; cuBLAS)
//                                       dW_c += dz^T h_t        (fp32, C = D; cuBLAS)
//               grad_weight[c] = dW_c   (rounded once: fp32 sums across token chunks)
//             Hopper: the GEMM's epilogue writes dz (bf16) straight from the accumulators (z never
//             leaves registers); a small pass adds the target column's term.
// Extra memory: one fp32 tile and one dz tile (kTokenChunk x kVocabChunk), an fp32 [vocab chunk, H]
// dW buffer and an fp32 [N, H] dh buffer; never [N, V].
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>

#include "common/gemm_sm90_torch.h"
#include "logprobs/logprobs.h"
#include "logprobs/logprobs_sm90.h"
#include "logprobs/logprobs_torch_checks.h"
#include "logprobs/vocab_chunks.h"

namespace pykernels::logprobs {
namespace {

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, error); }

cudaStream_t current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

DType dtype_of(const at::Tensor& t) { return float_dtype(t.scalar_type(), "tensor"); }

// Out-of-range targets, with no host sync on the default path (the op stays capturable in a CUDA
// graph and never stalls the stream): the finalize kernel gives such a token a NaN logprob and
// writes its index + 1 into a host-mapped flag, which the next call on any device reads and reports
// as a ValueError. PYKERNELS_CHECK_TARGETS=1 checks each call's targets before it runs instead
// (one host sync per call; skipped while a stream is being captured) and names the bad target.
// The kernels read a target's logit only when it lies in their chunk: never an out-of-bounds read.
int64_t* bad_target_flag() {
  static int64_t* flag = [] {
    void* host = nullptr;
    const cudaError_t status = cudaHostAlloc(&host, sizeof(int64_t), cudaHostAllocMapped | cudaHostAllocPortable);
    TORCH_CHECK(status == cudaSuccess, "token_logprobs: cannot allocate the mapped target-check flag: ",
                cudaGetErrorString(status));
    *static_cast<volatile int64_t*>(host) = 0;
    return static_cast<int64_t*>(host);  // with unified addressing, also the device's pointer
  }();
  return flag;
}

void report_earlier_bad_target(int64_t* flag) {
  volatile int64_t* seen = flag;
  const int64_t token = *seen;
  if (token == 0) return;
  *seen = 0;
  TORCH_CHECK_VALUE(false, "targets[", token - 1, "] of an earlier token_logprobs call on CUDA was outside the ",
                    "vocabulary and not ignore_index (its logprob came back NaN); set PYKERNELS_CHECK_TARGETS=1 to ",
                    "check every call before it runs");
}

bool check_targets_eagerly(cudaStream_t stream) {
  const char* env = std::getenv("PYKERNELS_CHECK_TARGETS");
  if (env == nullptr || std::strcmp(env, "1") != 0) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &capture) == cudaSuccess && capture == cudaStreamCaptureStatusNone;
}

// The eager check (a host sync): names the first bad target.
void check_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index) {
  const at::Tensor bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab));
  if (!bad.any().item<bool>()) return;
  const int64_t index = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK_VALUE(false, "targets[", index, "] = ", targets[index].item<int64_t>(),
                    " is outside the vocabulary [0, ", vocab, ") and is not ignore_index (", ignore_index, ")");
}

// z [tokens, vocab rows] = scale * h[t0:] W[v0:]^T in fp32, rows padded to ld.
void logits_tile(const at::Tensor& hidden, const at::Tensor& weight, int64_t t0, int64_t tokens, int64_t v0,
                 int64_t rows, float scale, at::Tensor& z, int64_t ld, cudaStream_t stream) {
  const int64_t h = hidden.size(1);
  const int64_t elem = hidden.element_size();
  gemm::GemmParams g{};
  g.m = tokens, g.n = rows, g.k = h;
  g.a = static_cast<const char*>(hidden.data_ptr()) + t0 * h * elem, g.lda = h, g.a_transposed = false;
  g.b = static_cast<const char*>(weight.data_ptr()) + v0 * h * elem, g.ldb = h, g.b_transposed = true;
  g.c = nullptr, g.ldc = ld, g.d = z.data_ptr(), g.ldd = ld;
  g.ab_dtype = dtype_of(hidden), g.d_dtype = DType::kFloat32, g.alpha = scale, g.beta = 0.0f;
  gemm::run_gemm(g, stream);
}

Stats stats_of(at::Tensor& stats) {
  return {stats[0].data_ptr<float>(), stats[1].data_ptr<float>(), stats[2].data_ptr<float>()};
}

// The Hopper kernels take bf16 with 16-byte rows (TMA); PYKERNELS_SM90=0 keeps the sm80 path.
bool use_sm90(const at::Tensor& hidden, const at::Tensor& weight) {
  return hidden.scalar_type() == at::kBFloat16 && hidden.size(1) % 8 == 0 && is_aligned(hidden.data_ptr(), 16) &&
         is_aligned(weight.data_ptr(), 16) && logprobs_sm90_built() && gemm::sm90_usable(hidden.get_device());
}

// out (+)= a @ b with fp32 out and accumulator, a and b in the input dtype (the backward's dh and dW):
// on cuBLAS through ATen's out_dtype overload of addmm. On an H100 our sm_90a core ran these at
// ~540-600 TFLOP/s (41 + 34 ms at N 16384, H 4096, V 151936) where cuBLAS runs such GEMMs at 720-810
// (benchmarks/results/h100.md). Should that overload refuse (a torch without it for these dtypes),
// our GEMM does it, with one warning.
void accumulate_fp32(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate,
                     cudaStream_t stream) {
  static std::atomic<bool> use_cublas{true};
  if (use_cublas.load()) {
    try {
      at::addmm_out(out, out, a, b, at::kFloat, /*beta=*/accumulate ? 1 : 0, /*alpha=*/1);
      return;
    } catch (const c10::Error& error) {
      use_cublas.store(false);
      TORCH_WARN("token_logprobs backward: cuBLAS (aten addmm with out_dtype) refused the fp32-output GEMM (",
                 error.what_without_backtrace(), "); pykernels' GEMM runs it from now on");
    }
  }
  gemm::GemmParams g{};
  g.m = a.size(0), g.n = b.size(1), g.k = a.size(1);
  g.a_transposed = a.stride(0) == 1 && a.size(1) > 1;  // a^T view of a row-major tensor
  g.a = a.data_ptr(), g.lda = g.a_transposed ? a.stride(1) : a.stride(0);
  g.b = b.data_ptr(), g.ldb = b.stride(0), g.b_transposed = false;
  g.c = accumulate ? out.data_ptr() : nullptr, g.ldc = out.stride(0);
  g.d = out.data_ptr(), g.ldd = out.stride(0);
  g.ab_dtype = dtype_of(a), g.d_dtype = DType::kFloat32, g.alpha = 1.0f, g.beta = accumulate ? 1.0f : 0.0f;
  gemm::run_gemm(g, stream);
}

// z_target [N]: the logit of each token's target (0 where it is no vocabulary entry).
at::Tensor target_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, float scale,
                         cudaStream_t stream) {
  at::Tensor z_target = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
  check_launch(launch_target_logits({hidden.data_ptr(), weight.data_ptr(), hidden.size(0), hidden.size(1),
                                     weight.size(0), targets.data_ptr<int64_t>(), scale, z_target.data_ptr<float>()},
                                    stream));
  return z_target;
}

// The forward's running stats: per (vocab chunk, token chunk) the logits tile and its fold. Returns
// the target logits (finalize's `picked`).
at::Tensor fold_stats(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const Sizes& s,
                      float scale, at::Tensor& stats, cudaStream_t stream) {
  at::Tensor picked = at::zeros({s.n}, hidden.options().dtype(at::kFloat));
  const int64_t ld = padded_row_length(std::min(kVocabChunk, s.v));
  at::Tensor z = at::empty({std::min(kTokenChunk, s.n), ld}, hidden.options().dtype(at::kFloat));
  for (int64_t vc = 0; vc < chunk_count(s.v, kVocabChunk); ++vc) {
    const auto [v0, rows] = chunk_at(s.v, kVocabChunk, vc);
    for (int64_t tc = 0; tc < chunk_count(s.n, kTokenChunk); ++tc) {
      const auto [t0, tokens] = chunk_at(s.n, kTokenChunk, tc);
      logits_tile(hidden, weight, t0, tokens, v0, rows, scale, z, ld, stream);
      check_launch(launch_fold({z.data_ptr<float>(), tokens, rows, ld, t0, v0, targets.data_ptr<int64_t>(),
                                stats_of(stats), picked.data_ptr<float>()}, stream));
    }
  }
  return picked;
}

// The same on Hopper: per (vocab chunk, token chunk) the partials GEMM and the fold of its
// partials; the target logits from one dot per token.
at::Tensor fold_stats_sm90(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                           const Sizes& s, float scale, at::Tensor& stats, cudaStream_t stream) {
  const int device = hidden.get_device();
  const int64_t elem = hidden.element_size();
  const int64_t plane = vocab_tiles(std::min(kSm90VocabChunk, s.v)) * partial_rows(std::min(kTokenChunk, s.n));
  at::Tensor planes = at::empty({3 * plane}, hidden.options().dtype(at::kFloat));
  float* max_z = planes.data_ptr<float>();
  for (int64_t vc = 0; vc < chunk_count(s.v, kSm90VocabChunk); ++vc) {
    const auto [v0, rows] = chunk_at(s.v, kSm90VocabChunk, vc);
    for (int64_t tc = 0; tc < chunk_count(s.n, kTokenChunk); ++tc) {
      const auto [t0, tokens] = chunk_at(s.n, kTokenChunk, tc);
      const SoftmaxPartialsSm90Params p{{static_cast<const char*>(hidden.data_ptr()) + t0 * s.h * elem,
                                         static_cast<const char*>(weight.data_ptr()) + v0 * s.h * elem, tokens, rows,
                                         s.h, scale},
                                        max_z, max_z + plane, max_z + 2 * plane};
      const at::Tensor space = gemm::sm90_workspace(softmax_partials_sm90_workspace_bytes(p, device), device);
      check_launch(launch_softmax_partials_sm90(p, space.data_ptr(), device, stream));
      check_launch(launch_fold_partials({p.max_z, p.sum_exp, p.sum_exp_z, tokens, vocab_tiles(rows),
                                         partial_rows(tokens), t0, stats_of(stats)}, stream));
    }
  }
  return target_logits(hidden, weight, targets, scale, stream);
}

// hidden_grad_terms is not implemented here yet: grad_terms comes back empty and the backward
// recomputes the logits instead (pykernels/ops/logprobs.py falls back on an empty grad_terms).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs_cuda(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double temperature,
    int64_t ignore_index, int64_t hidden_grad_terms) {
  const Sizes s = check_inputs(hidden, weight, targets, temperature);
  check_terms(hidden_grad_terms);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor logprobs = at::zeros({s.n}, f32), entropy = at::zeros({s.n}, f32), lse = at::zeros({s.n}, f32);
  const at::Tensor no_terms = at::empty({0}, f32);
  int64_t* bad_target = bad_target_flag();
  report_earlier_bad_target(bad_target);
  if (s.n == 0) return {logprobs, entropy, lse, no_terms};
  const cudaStream_t stream = current_stream(hidden);
  if (check_targets_eagerly(stream)) check_targets(targets, s.v, ignore_index);
  const float scale = static_cast<float>(1.0 / temperature);
  at::Tensor stats = at::zeros({3, s.n}, f32);
  stats[0].fill_(-std::numeric_limits<float>::infinity());
  const at::Tensor picked = use_sm90(hidden, weight) ? fold_stats_sm90(hidden, weight, targets, s, scale, stats, stream)
                                                     : fold_stats(hidden, weight, targets, s, scale, stats, stream);
  check_launch(launch_finalize({s.n, targets.data_ptr<int64_t>(), ignore_index, s.v, bad_target, stats_of(stats),
                                picked.data_ptr<float>(), logprobs.data_ptr<float>(), entropy.data_ptr<float>(),
                                lse.data_ptr<float>()}, stream));
  return {logprobs, entropy, lse, no_terms};
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_backward_cuda(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& entropy,
    double temperature, int64_t ignore_index, bool compute_grad_hidden, bool compute_grad_weight) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const BackwardInputs in = check_backward_inputs(grad_logprobs, grad_entropy, hidden, weight, targets, lse, entropy,
                                                  temperature, ignore_index);
  const Sizes& s = in.sizes;
  const cudaStream_t stream = current_stream(hidden);
  const auto f32 = hidden.options().dtype(at::kFloat);
  const at::Tensor &g_lp = in.grad_logprob, &g_ent = in.grad_entropy, &lse_c = in.lse, &ent_c = in.entropy;
  at::Tensor dh = compute_grad_hidden ? at::zeros({s.n, s.h}, f32) : at::Tensor();
  at::Tensor grad_weight = compute_grad_weight ? at::empty_like(weight) : at::empty({0}, weight.options());
  if (s.n == 0 || !(compute_grad_hidden || compute_grad_weight)) {
    if (compute_grad_weight) grad_weight.zero_();
    return {compute_grad_hidden ? at::zeros_like(hidden) : at::empty({0}, hidden.options()), grad_weight};
  }
  const float scale = static_cast<float>(1.0 / temperature);
  const int64_t ld = padded_row_length(std::min(kVocabChunk, s.v)), chunk = std::min(kTokenChunk, s.n);
  // CUTLASS's TMA store of dz needs each chunk's vocabulary width in 16-byte units: a vocabulary that
  // is no multiple of 8 (GPT-2's 50257) takes the sm80 grad kernel (the forward has no such store).
  const bool sm90 = use_sm90(hidden, weight) && s.v % 8 == 0;
  const int device = hidden.get_device();
  at::Tensor z = sm90 ? at::Tensor() : at::empty({chunk, ld}, f32);
  at::Tensor dz = at::empty({chunk, ld}, hidden.options());
  at::Tensor dw = compute_grad_weight ? at::empty({std::min(kVocabChunk, s.v), s.h}, f32) : at::Tensor();
  const at::Tensor z_target = sm90 ? target_logits(hidden, weight, targets, scale, stream) : at::Tensor();
  const at::Tensor shift = sm90 ? ent_c - lse_c : at::Tensor();
  const int64_t elem = hidden.element_size();
  for (int64_t vc = 0; vc < chunk_count(s.v, kVocabChunk); ++vc) {
    const auto [v0, rows] = chunk_at(s.v, kVocabChunk, vc);
    const char* w_chunk = static_cast<const char*>(weight.data_ptr()) + v0 * s.h * elem;
    for (int64_t tc = 0; tc < chunk_count(s.n, kTokenChunk); ++tc) {
      const auto [t0, tokens] = chunk_at(s.n, kTokenChunk, tc);
      const char* h_chunk = static_cast<const char*>(hidden.data_ptr()) + t0 * s.h * elem;
      if (sm90) {  // dz from the GEMM's epilogue, then the target column's term
        const LogitGradSm90Params p{{h_chunk, w_chunk, tokens, rows, s.h, scale},
                                    lse_c.data_ptr<float>() + t0,
                                    shift.data_ptr<float>() + t0,
                                    g_lp.data_ptr<float>() + t0,
                                    g_ent.data_ptr<float>() + t0,
                                    dz.data_ptr(),
                                    ld};
        const at::Tensor space = gemm::sm90_workspace(logit_grad_sm90_workspace_bytes(p, device), device);
        check_launch(launch_logit_grad_sm90(p, space.data_ptr(), device, stream));
        check_launch(launch_fix_target_grads({tokens, rows, t0, v0, targets.data_ptr<int64_t>(),
                                              z_target.data_ptr<float>(), lse_c.data_ptr<float>(),
                                              ent_c.data_ptr<float>(), g_lp.data_ptr<float>(),
                                              g_ent.data_ptr<float>(), scale, dz.data_ptr(), ld}, stream));
      } else {
        logits_tile(hidden, weight, t0, tokens, v0, rows, scale, z, ld, stream);
        check_launch(launch_grad({z.data_ptr<float>(), tokens, rows, ld, t0, v0, targets.data_ptr<int64_t>(),
                                  lse_c.data_ptr<float>(), ent_c.data_ptr<float>(), g_lp.data_ptr<float>(),
                                  g_ent.data_ptr<float>(), scale, dz.data_ptr(), ld, dtype_of(hidden)}, stream));
      }
      const at::Tensor dz_t = dz.narrow(0, 0, tokens).narrow(1, 0, rows);
      if (compute_grad_hidden) {  // dh[t0:] += dz W_c
        at::Tensor dh_t = dh.narrow(0, t0, tokens);
        accumulate_fp32(dh_t, dz_t, weight.narrow(0, v0, rows), /*accumulate=*/true, stream);
      }
      if (compute_grad_weight) {  // dW_c (+)= dz^T h_t
        at::Tensor dw_c = dw.narrow(0, 0, rows);
        accumulate_fp32(dw_c, dz_t.t(), hidden.narrow(0, t0, tokens), /*accumulate=*/t0 > 0, stream);
      }
    }
    if (compute_grad_weight) grad_weight.narrow(0, v0, rows).copy_(dw.narrow(0, 0, rows));
  }
  return {compute_grad_hidden ? dh.to(hidden.scalar_type()) : at::empty({0}, hidden.options()), grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("token_logprobs", &token_logprobs_cuda);
  m.impl("token_logprobs_backward", &token_logprobs_backward_cuda);
}

}  // namespace pykernels::logprobs
