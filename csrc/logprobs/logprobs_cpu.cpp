// CPU implementation of the fused token-logprob ops (schemas in csrc/torch_bindings.cpp).
//
// The [N, V] logits never exist: the vocabulary is cut into blocks of kVocabBlock rows of W, the
// tokens into chunks of kTokenChunk, and each (block, chunk) logits tile, [vocab][tokens] in fp32,
// is folded into per-token running statistics (max, sum exp, sum exp * z: online log-sum-exp and
// entropy) while it is in cache. Threads split the vocabulary: each reads its rows of W once per
// pass, keeps its own statistics (merged at the end) and owns its rows of dW outright, so dW is
// summed over all tokens in an fp32 block buffer and rounded once (bf16 accumulation across
// chunks diverges: Liger-Kernel#512) without an fp32 [V, H] buffer. The backward recomputes each
// tile from the saved log-sum-exp, turns it into dz in place and feeds dz to two GEMMs:
// dW_block += dz^T h and dh += dz W_block (per-thread fp32 partials of dh, summed at the end).
// With a frozen W the forward computes dlogprob/dh itself and nothing is recomputed (see forward).
//
// GEMMs: bf16 inputs on a CPU with AVX-512 BF16 use our micro-kernel (exact bf16 products, fp32
// sums, so logits are as good as fp32 logits of the bf16 inputs); anything else goes to torch's
// fp32 BLAS on fp32 copies (hidden converted once, W one block at a time).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_isa.h"
#include "common/cpu_memory.h"
#include "logprobs/logprobs_cpu_kernels.h"
#include "logprobs/logprobs_torch_checks.h"

namespace pykernels::logprobs {
namespace {

using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;  // see lora_cpu.cpp

constexpr int64_t kVocabBlock = 512;  // rows of W per task (also K of dh += dz W: fewer passes over dh)
constexpr int64_t kTokenChunk = 512;  // multiple of gemm::kPanel

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

const uint16_t* bf16_data(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }

// bf16 GEMMs on packed operands (see the header of this file).
class Bf16Gemms {
 public:
  Bf16Gemms(const at::Tensor& hidden, const at::Tensor& weight, bool grad_weight)
      : n_(hidden.size(0)), h_(hidden.size(1)), weight_(bf16_data(weight)) {
    hidden_t_.resize(gemm::panels(n_) * gemm::panel_stride(h_));
    gemm::pack_transposed(bf16_data(hidden), n_, h_, h_, hidden_t_.data());
    if (grad_weight) {
      hidden_rows_.resize(gemm::panels(h_) * gemm::panel_stride(round_up(n_, 2)));
      gemm::pack_rows(bf16_data(hidden), n_, round_up(n_, 2), h_, h_, hidden_rows_.data());
    }
  }
  static int64_t ld(int64_t tokens) { return round_up(tokens, gemm::kPanel); }
  static int64_t acc_ld(int64_t h) { return gemm::padded_ld(h); }

  void begin_block(int64_t v0, int64_t rows, bool grad_hidden) {
    // The block's rows of W, the logits GEMM's A, packed for the AMX tiles once for all token chunks
    // (gemm_bf16 would copy them again for each); nothing to share with a single chunk.
    thread_local AlignedVector<uint16_t> a;
    const int64_t a_size = n_ > kTokenChunk ? gemm::prepacked_a_size(rows, h_) : 0;
    a.resize(a_size);
    if (a_size > 0) gemm::prepack_a(weight_ + v0 * h_, h_, rows, h_, a.data());
    block_a_ = a_size > 0 ? a.data() : nullptr;
    if (!grad_hidden) return;
    thread_local AlignedVector<uint32_t> w;  // this block of W packed for dh = dz W
    w.resize(gemm::panels(h_) * gemm::panel_stride(round_up(rows, 2)));
    gemm::pack_rows(weight_ + v0 * h_, rows, round_up(rows, 2), h_, h_, w.data());
    block_rows_ = w.data();
  }

  void logits(int64_t v0, int64_t rows, int64_t t0, int64_t tokens, float* tile, int64_t ld) const {
    gemm::gemm_bf16(rows, tokens, h_, weight_ + v0 * h_, h_, block_a_,
                    hidden_t_.data() + t0 / gemm::kPanel * gemm::panel_stride(h_), gemm::panel_stride(h_), tile, ld,
                    false);
  }

  // dw_block [rows, H] (+)= dz^T h and dh[t0:] += dz W_block, from an fp32 tile dz [rows][ld] (scale * dz
  // in the backward; softmax weights in a forward that accumulates hidden-gradient terms). dh and
  // dw_block rows are acc_ld(H) apart.
  void accumulate(int64_t rows, int64_t t0, int64_t tokens, const float* dz, int64_t ld, float* dh, float* dw_block,
                  bool first_chunk) const {
    thread_local AlignedVector<uint16_t> dz_t, dz_rows;
    const int64_t k_tokens = round_up(tokens, 2), k_rows = round_up(rows, 2);
    dz_t.resize(rows * k_tokens);
    dz_rows.resize(dh ? tokens * k_rows : 0);
    cpu::to_bf16_both(dz, rows, tokens, ld, dz_t.data(), k_tokens, dh ? dz_rows.data() : nullptr, k_rows);
    if (dw_block) {
      const int64_t stride = gemm::panel_stride(round_up(n_, 2));
      gemm::gemm_bf16(rows, h_, k_tokens, dz_t.data(), k_tokens, hidden_rows_.data() + t0 / 2 * gemm::kPanel, stride,
                     dw_block, acc_ld(h_), !first_chunk);
    }
    if (dh) {
      gemm::gemm_bf16(tokens, h_, k_rows, dz_rows.data(), k_rows, block_rows_, gemm::panel_stride(k_rows),
                     dh + t0 * acc_ld(h_), acc_ld(h_), true);
    }
  }

 private:
  int64_t n_, h_;
  const uint16_t* weight_;
  AlignedVector<uint32_t> hidden_t_, hidden_rows_;
  static thread_local const uint32_t* block_rows_;
  static thread_local const uint16_t* block_a_;
};
thread_local const uint32_t* Bf16Gemms::block_rows_ = nullptr;
thread_local const uint16_t* Bf16Gemms::block_a_ = nullptr;

// torch's fp32 BLAS on fp32 copies: any dtype, any CPU.
class Fp32Gemms {
 public:
  Fp32Gemms(const at::Tensor& hidden, const at::Tensor& weight, bool grad_weight)
      : hidden_(hidden.to(at::kFloat)), weight_(weight) {}
  static int64_t ld(int64_t tokens) { return tokens; }
  static int64_t acc_ld(int64_t h) { return h; }

  void begin_block(int64_t v0, int64_t rows, bool grad_hidden) {
    block() = weight_.narrow(0, v0, rows).to(at::kFloat).contiguous();
  }

  void logits(int64_t v0, int64_t rows, int64_t t0, int64_t tokens, float* tile, int64_t ld) const {
    at::Tensor out = at::from_blob(tile, {rows, tokens});
    at::mm_out(out, block(), hidden_.narrow(0, t0, tokens).t());
  }

  void accumulate(int64_t rows, int64_t t0, int64_t tokens, float* dz, int64_t ld, float* dh, float* dw_block,
                  bool first_chunk) const {
    const at::Tensor dz_t = at::from_blob(dz, {rows, tokens});
    if (dw_block) {
      at::Tensor dw = at::from_blob(dw_block, {rows, hidden_.size(1)});
      if (first_chunk) {
        at::mm_out(dw, dz_t, hidden_.narrow(0, t0, tokens));
      } else {
        dw.addmm_(dz_t, hidden_.narrow(0, t0, tokens));
      }
    }
    if (dh) at::from_blob(dh + t0 * hidden_.size(1), {tokens, hidden_.size(1)}).addmm_(dz_t.t(), block());
  }

 private:
  static at::Tensor& block() {
    thread_local at::Tensor w;  // this thread's block of W in fp32
    return w;
  }
  at::Tensor hidden_, weight_;
};

// The tiles a thread works on, reused across calls (no allocation, so no page faults, per tile).
float* thread_tile(int64_t floats) {
  thread_local AlignedVector<float> tile;
  if (static_cast<int64_t>(tile.size()) < floats) tile.resize(floats);
  return tile.data();
}

void check_targets(const at::Tensor& targets, int64_t vocab, int64_t ignore_index) {
  const int64_t* t = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < targets.numel(); ++i) {
    TORCH_CHECK_VALUE(t[i] == ignore_index || (t[i] >= 0 && t[i] < vocab), "targets[", i, "] = ", t[i],
                      " is outside the vocabulary [0, ", vocab, ") and is not ignore_index (", ignore_index, ")");
  }
}

struct Forward {
  at::Tensor logprobs, entropy, lse, grad_terms;
};

// Rescales this thread's gradient-term accumulators of one token from running max old_max to new_max
// (see forward): ua *= alpha, ue = alpha (ue + (old_max - new_max) ua), alpha = exp(old_max - new_max).
void rebase_terms(float* ua, float* ue, int64_t h, float old_max, float new_max) {
  const float alpha = std::exp(old_max - new_max), shift = old_max - new_max;
  if (ue != nullptr) {
    for (int64_t k = 0; k < h; ++k) ue[k] = alpha * (ue[k] + shift * ua[k]);
  }
  for (int64_t k = 0; k < h; ++k) ua[k] *= alpha;
}

// grad_terms [terms, N, H] from the threads' accumulators (fp32 tensors [threads, N, H]); see forward.
at::Tensor combine_terms(const at::Tensor& stats, const at::Tensor& ua, const at::Tensor& ue, const at::Tensor& max_z,
                         const at::Tensor& sum_exp, const Forward& out, const at::Tensor& picked,
                         const at::Tensor& weight, const at::Tensor& targets, int64_t ignore_index, float scale) {
  const at::Tensor thread_max = stats.select(1, 0), thread_sum = stats.select(1, 1);  // [threads, N]
  const at::Tensor factor = at::where(thread_sum > 0, at::exp(thread_max - max_z) / sum_exp, at::zeros_like(thread_sum));
  const at::Tensor keep = (targets != ignore_index).to(at::kFloat).unsqueeze(1);
  const at::Tensor w_target = weight.index_select(0, targets.clamp(0, weight.size(0) - 1)).to(at::kFloat);
  const at::Tensor log_p = picked - out.lse;  // log p(target)
  // d logprob / dh = scale ((1 - p_t) W_t - sum_{v != t} p_v W_v); 1 - p_t as -expm1, exact near p_t = 1.
  const at::Tensor others = (factor.unsqueeze(2) * ua).sum(0);
  at::Tensor d_logprob = scale * (-at::expm1(log_p)).unsqueeze(1) * w_target - scale * others;
  if (!ue.defined()) return (d_logprob * keep).unsqueeze(0);
  // d entropy / dh = -scale sum_v p_v (z_v - lse + H) W_v: the non-targets from the accumulators,
  // re-based from each thread's max to lse, plus the target's own term.
  const at::Tensor rebase = at::where(thread_sum > 0, thread_max - out.lse + out.entropy,  // -inf * 0 is NaN
                                      at::zeros_like(thread_sum)).unsqueeze(2);                // [threads, N, 1]
  const at::Tensor non_targets = (factor.unsqueeze(2) * (ue + rebase * ua)).sum(0);
  const at::Tensor target_term = (at::exp(log_p) * (log_p + out.entropy)).unsqueeze(1) * w_target;
  const at::Tensor d_entropy = -scale * (non_targets + target_term);
  return at::stack({d_logprob * keep, d_entropy * keep});
}

// terms > 0 (a frozen weight and hidden needing a gradient) also accumulates, for every token, the
// gradient of its logprob (and with terms = 2 of its entropy) with respect to its hidden state:
// sums of softmax-weighted rows of W, accumulated like the output of flash attention (weights
// exp(z - running max), rescaled when the max moves; the target's own row kept out and added
// exactly at the end). The backward is then [N, H] arithmetic: 4NHV in all instead of 6NHV with a
// recomputing backward.
template <class Gemms>
Forward forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, float scale,
                int64_t ignore_index, int64_t terms) {
  const Sizes s{hidden.size(0), hidden.size(1), weight.size(0)};
  const int threads = at::get_num_threads();
  // Per-thread running statistics [threads][3][N]: max_z, sum_exp, sum_exp_z.
  at::Tensor stats = at::zeros({threads, 3, s.n}, at::kFloat);
  stats.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  at::Tensor target_logit = at::zeros({s.n}, at::kFloat);
  // Per-thread term accumulators: ua = sum_{v != t} e_v W_v, ue = sum_{v != t} e_v (z_v - max) W_v.
  const int64_t acc_ld = Gemms::acc_ld(s.h);
  at::Tensor ua = terms > 0 ? at::zeros({threads, s.n, acc_ld}, at::kFloat) : at::Tensor();
  at::Tensor ue = terms > 1 ? at::zeros({threads, s.n, acc_ld}, at::kFloat) : at::Tensor();
  Gemms gemms(hidden, weight, false);
  const int64_t* tgt = targets.data_ptr<int64_t>();
  float* picked = target_logit.data_ptr<float>();
  const bool avx512 = uses_avx512(active_cpu_isa());
  const int64_t blocks = (s.v + kVocabBlock - 1) / kVocabBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const BelowAutograd below_autograd;
    const int thread = at::get_thread_num();
    float* mine = stats.data_ptr<float>() + thread * 3 * s.n;
    float* my_ua = terms > 0 ? ua.data_ptr<float>() + thread * s.n * acc_ld : nullptr;
    float* my_ue = terms > 1 ? ue.data_ptr<float>() + thread * s.n * acc_ld : nullptr;
    float* tile = thread_tile(kVocabBlock * Gemms::ld(kTokenChunk));
    thread_local AlignedVector<float> weighted, old_max, old_sum;
    if (terms > 1) weighted.resize(kVocabBlock * Gemms::ld(kTokenChunk));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kVocabBlock, rows = std::min(kVocabBlock, s.v - v0);
      gemms.begin_block(v0, rows, terms > 0);
      for (int64_t t0 = 0; t0 < s.n; t0 += kTokenChunk) {
        const int64_t tokens = std::min(kTokenChunk, s.n - t0), ld = Gemms::ld(tokens);
        gemms.logits(v0, rows, t0, tokens, tile, ld);
        if (terms > 0) {
          old_max.assign(mine + t0, mine + t0 + tokens);
          old_sum.assign(mine + s.n + t0, mine + s.n + t0 + tokens);
        }
        cpu::fold_tile(tile, rows, tokens, ld, scale, {mine + t0, mine + s.n + t0, mine + 2 * s.n + t0}, avx512);
        for (int64_t t = 0; t < tokens; ++t) {  // each target lies in exactly one block: no race
          const int64_t row = tgt[t0 + t] - v0;
          if (row >= 0 && row < rows) picked[t0 + t] = tile[row * ld + t] * scale;
        }
        if (terms == 0) continue;
        for (int64_t t = 0; t < tokens; ++t) {
          if (old_sum[t] > 0 && old_max[t] != mine[t0 + t]) {
            rebase_terms(my_ua + (t0 + t) * acc_ld, my_ue ? my_ue + (t0 + t) * acc_ld : nullptr, s.h, old_max[t],
                         mine[t0 + t]);
          }
        }
        cpu::exp_tile(tile, terms > 1 ? weighted.data() : nullptr, rows, tokens, ld, scale, mine + t0, avx512);
        for (int64_t t = 0; t < tokens; ++t) {  // the target's own row is added exactly at the end
          const int64_t row = tgt[t0 + t] - v0;
          if (row >= 0 && row < rows) {
            tile[row * ld + t] = 0.0f;
            if (terms > 1) weighted[row * ld + t] = 0.0f;
          }
        }
        gemms.accumulate(rows, t0, tokens, tile, ld, my_ua, nullptr, false);  // ua[t0:] += e W_block
        if (terms > 1) gemms.accumulate(rows, t0, tokens, weighted.data(), ld, my_ue, nullptr, false);
      }
    }
  });
  // Merge the threads' statistics (threads that saw no block have sum_exp 0 and are skipped).
  Forward out{at::empty({s.n}, at::kFloat), at::empty({s.n}, at::kFloat), at::empty({s.n}, at::kFloat),
              at::empty({0}, at::kFloat)};
  at::Tensor max_all = at::empty({s.n}, at::kFloat), sum_all = at::empty({s.n}, at::kFloat);
  const float* st = stats.data_ptr<float>();
  for (int64_t t = 0; t < s.n; ++t) {
    float max_z = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < threads; ++i) {
      if (st[(i * 3 + 1) * s.n + t] > 0) max_z = std::max(max_z, st[i * 3 * s.n + t]);
    }
    double sum = 0, sum_z = 0;
    for (int i = 0; i < threads; ++i) {
      const double m = st[i * 3 * s.n + t], e = st[(i * 3 + 1) * s.n + t], ez = st[(i * 3 + 2) * s.n + t];
      if (e <= 0) continue;
      const double alpha = std::exp(m - max_z);
      sum += alpha * e;
      sum_z += alpha * (ez + (m - max_z) * e);
    }
    const float lse = max_z + static_cast<float>(std::log(sum));
    const bool ignored = tgt[t] == ignore_index;
    max_all.data_ptr<float>()[t] = max_z;
    sum_all.data_ptr<float>()[t] = static_cast<float>(sum);
    out.lse.data_ptr<float>()[t] = lse;
    out.logprobs.data_ptr<float>()[t] = ignored ? 0.0f : picked[t] - lse;
    out.entropy.data_ptr<float>()[t] = ignored ? 0.0f : static_cast<float>(std::log(sum) - sum_z / sum);
  }
  if (terms > 0) {
    const at::Tensor ua_h = ua.narrow(2, 0, s.h), ue_h = terms > 1 ? ue.narrow(2, 0, s.h) : ue;  // padding off
    out.grad_terms = combine_terms(stats, ua_h, ue_h, max_all, sum_all, out, target_logit, weight, targets,
                                   ignore_index, scale);
  }
  return out;
}

template <class Gemms>
void backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
              const at::Tensor& entropy, const at::Tensor& grad_logprob, const at::Tensor& grad_entropy, float scale,
              at::Tensor* grad_hidden, at::Tensor* grad_weight) {
  const Sizes s{hidden.size(0), hidden.size(1), weight.size(0)};
  const int threads = at::get_num_threads();
  const int64_t acc_ld = Gemms::acc_ld(s.h);
  at::Tensor dh_parts = grad_hidden ? at::zeros({threads, s.n, acc_ld}, at::kFloat) : at::Tensor();
  Gemms gemms(hidden, weight, grad_weight != nullptr);
  const int64_t* tgt = targets.data_ptr<int64_t>();
  const float* g_lp = grad_logprob.data_ptr<float>();
  const cpu::GradInputs in{lse.data_ptr<float>(), entropy.data_ptr<float>(), g_lp, grad_entropy.data_ptr<float>()};
  const bool avx512 = uses_avx512(active_cpu_isa());
  const int64_t blocks = (s.v + kVocabBlock - 1) / kVocabBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    const BelowAutograd below_autograd;
    float* dh = grad_hidden ? dh_parts.data_ptr<float>() + at::get_thread_num() * s.n * acc_ld : nullptr;
    float* tile = thread_tile(kVocabBlock * Gemms::ld(kTokenChunk));
    thread_local AlignedVector<float> dw_block;
    if (grad_weight) dw_block.resize(kVocabBlock * acc_ld);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t v0 = b * kVocabBlock, rows = std::min(kVocabBlock, s.v - v0);
      gemms.begin_block(v0, rows, grad_hidden != nullptr);
      for (int64_t t0 = 0; t0 < s.n; t0 += kTokenChunk) {
        const int64_t tokens = std::min(kTokenChunk, s.n - t0), ld = Gemms::ld(tokens);
        gemms.logits(v0, rows, t0, tokens, tile, ld);
        cpu::grad_tile(tile, rows, tokens, ld, scale, {in.lse + t0, in.entropy + t0, in.grad_logprob + t0,
                                                       in.grad_entropy + t0}, avx512);
        for (int64_t t = 0; t < tokens; ++t) {  // d logprob / dz_target = 1
          const int64_t row = tgt[t0 + t] - v0;
          if (row >= 0 && row < rows) tile[row * ld + t] += scale * g_lp[t0 + t];
        }
        gemms.accumulate(rows, t0, tokens, tile, ld, dh, grad_weight ? dw_block.data() : nullptr, t0 == 0);
      }
      if (grad_weight && grad_weight->scalar_type() == at::kBFloat16) {  // rounded once, straight into place
        auto* out = reinterpret_cast<uint16_t*>(grad_weight->data_ptr()) + v0 * s.h;
        cpu::to_bf16_both(dw_block.data(), rows, s.h, acc_ld, out, s.h, nullptr, 0);
      } else if (grad_weight) {
        grad_weight->narrow(0, v0, rows).copy_(at::from_blob(dw_block.data(), {rows, s.h}, {acc_ld, 1}));
      }
    }
  });
  if (grad_hidden) *grad_hidden = dh_parts.sum(0).narrow(1, 0, s.h).to(hidden.scalar_type());
}

bool use_bf16_gemm(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kBFloat16 && uses_avx512(active_cpu_isa()) && gemm::has_bf16_gemm();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_logprobs_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double temperature,
    int64_t ignore_index, int64_t hidden_grad_terms) {
  check_inputs(hidden, weight, targets, temperature);
  check_terms(hidden_grad_terms);
  check_targets(targets, weight.size(0), ignore_index);
  const float scale = static_cast<float>(1.0 / temperature);
  const int64_t terms = hidden.size(0) > 0 ? hidden_grad_terms : 0;
  Forward out = use_bf16_gemm(hidden) ? forward<Bf16Gemms>(hidden, weight, targets, scale, ignore_index, terms)
                                      : forward<Fp32Gemms>(hidden, weight, targets, scale, ignore_index, terms);
  if (terms == 0 && hidden_grad_terms > 0) out.grad_terms = at::zeros({hidden_grad_terms, 0, hidden.size(1)}, at::kFloat);
  return {out.logprobs, out.entropy, out.lse, out.grad_terms};
}

std::tuple<at::Tensor, at::Tensor> token_logprobs_backward_cpu(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse, const at::Tensor& entropy,
    double temperature, int64_t ignore_index, bool compute_grad_hidden, bool compute_grad_weight) {
  const BackwardInputs in = check_backward_inputs(grad_logprobs, grad_entropy, hidden, weight, targets, lse, entropy,
                                                  temperature, ignore_index);
  const Sizes& s = in.sizes;
  at::Tensor grad_hidden = at::empty({0}, hidden.options()), grad_weight = at::empty({0}, weight.options());
  if (compute_grad_weight) grad_weight = at::empty_like(weight);
  if (s.n > 0 && (compute_grad_hidden || compute_grad_weight)) {
    const float scale = static_cast<float>(1.0 / temperature);
    at::Tensor* gh = compute_grad_hidden ? &grad_hidden : nullptr;
    at::Tensor* gw = compute_grad_weight ? &grad_weight : nullptr;
    if (use_bf16_gemm(hidden)) {
      backward<Bf16Gemms>(hidden, weight, targets, in.lse, in.entropy, in.grad_logprob, in.grad_entropy, scale, gh, gw);
    } else {
      backward<Fp32Gemms>(hidden, weight, targets, in.lse, in.entropy, in.grad_logprob, in.grad_entropy, scale, gh, gw);
    }
  } else {
    if (compute_grad_hidden) grad_hidden = at::zeros_like(hidden);
    if (compute_grad_weight) grad_weight.zero_();
  }
  return {grad_hidden, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("token_logprobs", &token_logprobs_cpu);
  m.impl("token_logprobs_backward", &token_logprobs_backward_cpu);
}

}  // namespace pykernels::logprobs
