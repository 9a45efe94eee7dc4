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
//   backward  trainable lm_head: for each vocab chunk W_c:  dW_c = 0 (fp32)
//               for each token chunk:   z = h_t W_c^T / T, dz = scale dL/dz (input dtype)
//                                       dh_t += dz W_c          (fp32, C = D; cuBLAS)
//                                       dW_c += dz^T h_t        (fp32, C = D; cuBLAS)
//               grad_weight[c] = dW_c   (rounded once: fp32 sums across token chunks)
//             frozen lm_head (LoRA): token chunks outermost, dh_t = sum over W_c of dz W_c in
//               an fp32 buffer of one chunk, rounded once into dh.
//             Hopper: the GEMM's epilogue writes dz (bf16) straight from the accumulators (z never
//             leaves registers); a small pass adds the target column's term.
// Extra memory, never [N, V]: trainable, one fp32 tile (sm80) and one dz tile (kTokenChunk x
// kVocabChunk), an fp32 [vocab chunk, H] dW buffer and an fp32 [N, H] dh buffer; frozen, the same
// tiles and an fp32 dh buffer of kFrozenTokenChunk rows (8 MiB each at H 4096 on Hopper: 16 MiB
// where chunked torch holds 375 MiB at V 32000 and 1.8 GiB at V 151936).
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

#include "common/env_knob.h"
#include "common/gemm_sm90_torch.h"
#include "common/online_softmax.h"
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

// The Hopper lm_head GEMMs' tile: PYKERNELS_SM90_LOGPROBS_TILE (read on every call, so one process
// can time both: benchmarks/tile_sweep.py), else the default (logprobs_sm90.h).
LogprobsSm90Tile sm90_tile() {
  return env_knob<LogprobsSm90Tile>("PYKERNELS_SM90_LOGPROBS_TILE", logprobs_sm90_tile_for);
}

// The statistics epilogue's slack (PYKERNELS_SM90_LOGPROBS_FOLD, read on every call like the tile).
float sm90_fold_slack() {
  return env_knob<bool>("PYKERNELS_SM90_LOGPROBS_FOLD", logprobs_sm90_lazy_fold_for) ? kLazyMaxSlack : 0.0f;
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
  const LogprobsSm90Tile tile = sm90_tile();
  const float slack = sm90_fold_slack();
  for (int64_t vc = 0; vc < chunk_count(s.v, kSm90VocabChunk); ++vc) {
    const auto [v0, rows] = chunk_at(s.v, kSm90VocabChunk, vc);
    for (int64_t tc = 0; tc < chunk_count(s.n, kTokenChunk); ++tc) {
      const auto [t0, tokens] = chunk_at(s.n, kTokenChunk, tc);
      const SoftmaxPartialsSm90Params p{{static_cast<const char*>(hidden.data_ptr()) + t0 * s.h * elem,
                                         static_cast<const char*>(weight.data_ptr()) + v0 * s.h * elem, tokens, rows,
                                         s.h, scale, tile},
                                        max_z, max_z + plane, max_z + 2 * plane, slack};
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

// dz for one (token chunk, vocab chunk) of the backward: scale dL/dz in the input dtype, rows padded
// to ld. Hopper: from the GEMM's epilogue (z never leaves registers), then the target column's term;
// else the fp32 logits tile z and the grad kernel.
class LogitGrads {
 public:
  LogitGrads(const BackwardInputs& in, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
             float scale, int64_t token_chunk, cudaStream_t stream)
      : in_(in), hidden_(hidden), weight_(weight), targets_(targets), scale_(scale), stream_(stream),
        // CUTLASS's TMA store of dz needs each chunk's vocabulary width in 16-byte units: a vocabulary
        // that is no multiple of 8 (GPT-2's 50257) takes the sm80 grad kernel (the forward has no such store).
        sm90_(use_sm90(hidden, weight) && in.sizes.v % 8 == 0),
        ld_(padded_row_length(std::min(kVocabChunk, in.sizes.v))) {
    dz_ = at::empty({token_chunk, ld_}, hidden.options());
    if (sm90_) {
      tile_ = sm90_tile();
      z_target_ = target_logits(hidden, weight, targets, scale, stream);
      shift_ = in.entropy - in.lse;
    } else {
      z_ = at::empty({token_chunk, ld_}, hidden.options().dtype(at::kFloat));
    }
  }

  // dz [tokens, rows] of tokens t0.. and vocabulary rows v0.. (a view of the reused buffer).
  at::Tensor operator()(int64_t t0, int64_t tokens, int64_t v0, int64_t rows) {
    const Sizes& s = in_.sizes;
    const int64_t elem = hidden_.element_size();
    float* lse = in_.lse.data_ptr<float>();
    float* entropy = in_.entropy.data_ptr<float>();
    float* g_lp = in_.grad_logprob.data_ptr<float>();
    float* g_ent = in_.grad_entropy.data_ptr<float>();
    if (sm90_) {
      const LogitGradSm90Params p{{static_cast<const char*>(hidden_.data_ptr()) + t0 * s.h * elem,
                                   static_cast<const char*>(weight_.data_ptr()) + v0 * s.h * elem, tokens, rows, s.h,
                                   scale_, tile_},
                                  lse + t0,
                                  shift_.data_ptr<float>() + t0,
                                  g_lp + t0,
                                  g_ent + t0,
                                  dz_.data_ptr(),
                                  ld_};
      const int device = hidden_.get_device();
      const at::Tensor space = gemm::sm90_workspace(logit_grad_sm90_workspace_bytes(p, device), device);
      check_launch(launch_logit_grad_sm90(p, space.data_ptr(), device, stream_));
      check_launch(launch_fix_target_grads({tokens, rows, t0, v0, targets_.data_ptr<int64_t>(),
                                            z_target_.data_ptr<float>(), lse, entropy, g_lp, g_ent, scale_,
                                            dz_.data_ptr(), ld_},
                                           stream_));
    } else {
      logits_tile(hidden_, weight_, t0, tokens, v0, rows, scale_, z_, ld_, stream_);
      check_launch(launch_grad({z_.data_ptr<float>(), tokens, rows, ld_, t0, v0, targets_.data_ptr<int64_t>(), lse,
                                entropy, g_lp, g_ent, scale_, dz_.data_ptr(), ld_, dtype_of(hidden_)},
                               stream_));
    }
    return dz_.narrow(0, 0, tokens).narrow(1, 0, rows);
  }

 private:
  const BackwardInputs& in_;
  const at::Tensor &hidden_, &weight_, &targets_;
  const float scale_;
  const cudaStream_t stream_;
  const bool sm90_;
  LogprobsSm90Tile tile_{};
  const int64_t ld_;
  at::Tensor dz_, z_, z_target_, shift_;
};

// Frozen lm_head (LoRA / QLoRA): only dh. Token chunks outermost, so the fp32 accumulator covers one
// chunk of kFrozenTokenChunk tokens and each chunk's dh is rounded once into the output.
at::Tensor grad_hidden_only(const BackwardInputs& in, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, float scale, cudaStream_t stream) {
  const Sizes& s = in.sizes;
  const int64_t chunk = std::min(kFrozenTokenChunk, s.n);
  LogitGrads dz_of(in, hidden, weight, targets, scale, chunk, stream);
  at::Tensor dh = at::empty({s.n, s.h}, hidden.options());
  at::Tensor dh_chunk = at::empty({chunk, s.h}, hidden.options().dtype(at::kFloat));
  for (int64_t tc = 0; tc < chunk_count(s.n, kFrozenTokenChunk); ++tc) {
    const auto [t0, tokens] = chunk_at(s.n, kFrozenTokenChunk, tc);
    at::Tensor dh_t = dh_chunk.narrow(0, 0, tokens);
    for (int64_t vc = 0; vc < chunk_count(s.v, kVocabChunk); ++vc) {
      const auto [v0, rows] = chunk_at(s.v, kVocabChunk, vc);
      accumulate_fp32(dh_t, dz_of(t0, tokens, v0, rows), weight.narrow(0, v0, rows), /*accumulate=*/vc > 0, stream);
    }
    dh.narrow(0, t0, tokens).copy_(dh_t);
  }
  return dh;
}

// Trainable lm_head: vocab chunks outermost, so each chunk's dW is summed over all tokens in fp32
// and rounded once; dh accumulates over the vocab chunks in an fp32 [N, H] buffer.
std::tuple<at::Tensor, at::Tensor> grads_with_weight(const BackwardInputs& in, const at::Tensor& hidden,
                                                     const at::Tensor& weight, const at::Tensor& targets, float scale,
                                                     bool compute_grad_hidden, cudaStream_t stream) {
  const Sizes& s = in.sizes;
  const auto f32 = hidden.options().dtype(at::kFloat);
  LogitGrads dz_of(in, hidden, weight, targets, scale, std::min(kTokenChunk, s.n), stream);
  at::Tensor dh = compute_grad_hidden ? at::zeros({s.n, s.h}, f32) : at::Tensor();
  at::Tensor grad_weight = at::empty_like(weight);
  at::Tensor dw = at::empty({std::min(kVocabChunk, s.v), s.h}, f32);
  for (int64_t vc = 0; vc < chunk_count(s.v, kVocabChunk); ++vc) {
    const auto [v0, rows] = chunk_at(s.v, kVocabChunk, vc);
    at::Tensor dw_c = dw.narrow(0, 0, rows);
    for (int64_t tc = 0; tc < chunk_count(s.n, kTokenChunk); ++tc) {
      const auto [t0, tokens] = chunk_at(s.n, kTokenChunk, tc);
      const at::Tensor dz_t = dz_of(t0, tokens, v0, rows);
      if (compute_grad_hidden) {  // dh[t0:] += dz W_c
        at::Tensor dh_t = dh.narrow(0, t0, tokens);
        accumulate_fp32(dh_t, dz_t, weight.narrow(0, v0, rows), /*accumulate=*/true, stream);
      }
      // dW_c (+)= dz^T h_t
      accumulate_fp32(dw_c, dz_t.t(), hidden.narrow(0, t0, tokens), /*accumulate=*/t0 > 0, stream);
    }
    grad_weight.narrow(0, v0, rows).copy_(dw_c);
  }
  return {compute_grad_hidden ? dh.to(hidden.scalar_type()) : at::empty({0}, hidden.options()), grad_weight};
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_backward_cuda(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& entropy,
    double temperature, int64_t ignore_index, bool compute_grad_hidden, bool compute_grad_weight) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const BackwardInputs in = check_backward_inputs(grad_logprobs, grad_entropy, hidden, weight, targets, lse, entropy,
                                                  temperature, ignore_index);
  const Sizes& s = in.sizes;
  const at::Tensor no_weight_grad = at::empty({0}, weight.options());
  if (s.n == 0 || !(compute_grad_hidden || compute_grad_weight)) {
    return {compute_grad_hidden ? at::zeros_like(hidden) : at::empty({0}, hidden.options()),
            compute_grad_weight ? at::zeros_like(weight) : no_weight_grad};
  }
  const cudaStream_t stream = current_stream(hidden);
  const float scale = static_cast<float>(1.0 / temperature);
  if (!compute_grad_weight) return {grad_hidden_only(in, hidden, weight, targets, scale, stream), no_weight_grad};
  return grads_with_weight(in, hidden, weight, targets, scale, compute_grad_hidden, stream);
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("token_logprobs", &token_logprobs_cuda);
  m.impl("token_logprobs_backward", &token_logprobs_backward_cuda);
}

}  // namespace pykernels::logprobs
