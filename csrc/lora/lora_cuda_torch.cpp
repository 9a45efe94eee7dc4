// CUDA implementations of the fused LoRA ops (schemas in csrc/torch_bindings.cpp; the same results
// as lora_cpu.cpp up to rounding): checks, allocation on the current device and the composition of
// the launchers in lora.cu, nf4.cu and nf4_gemm_sm90.cu on torch's current stream.
//
//   forward   xa = x_lora A^T                  GEMM, fp32 out (kept for backward)
//             y  = scaling xa B^T + bias       low-rank term, written into y in x's dtype
//             y += x W^T                       GEMM with C = D = y (cuBLAS: the term costs a write
//                                              of y and a read of it as C)
//             or, on Hopper (the default there; PYKERNELS_SM90_LORA=cublas: the above), the last two
//             as one GEMM with the term and bias as extra K, y = [x | U] [W | V]^T
//             (lora/lora_extended_k.h), on the Hopper GEMM core as one group (its tile:
//             PYKERNELS_SM90_TILE);
//             or, with an NF4 W on Hopper and PYKERNELS_SM90_NF4=mainloop, y += x W^T by the GEMM that
//             decodes the codes in its mainloop (nf4/nf4_gemm_sm90.h), C = D = y: no dequantized W
//   backward  dxa = scaling dy B               GEMM, fp32 out
//             dB  = scaling dy^T xa            GEMM, fp32 out, cast to B's dtype
//             dA  = dxa^T x_lora               GEMM, fp32 out, cast to A's dtype
//             grad_x = dxa A, then += dy W     two GEMMs, the second with C = D = grad_x
//                                              (separate grad_x = dy W, grad_x_lora = dxa A with x_lora)
//                                              or, under PYKERNELS_SM90_LORA_GRAD_X=extended_k, dense W
//                                              and no x_lora, one GEMM: [dy | U] [W ; V^T]
// The GEMMs take one input dtype; products that meet an fp32 LoRA weight or the fp32 xa / dxa
// go to launch_rank_gemm instead, which reads each operand in its own dtype and sums in fp32, so
// nothing on the LoRA path is rounded to 16 bits before its output (as on the CPU and in PEFT,
// whose fp32 adapters see an fp32 copy of x); with bf16 x they run on the tensor-core GEMM, each fp32
// factor as three bf16 pieces (lora_rank_pieces.h; PYKERNELS_LORA_RANK_GEMM=simt keeps the FMA kernel).
// With an NF4 weight, chunks of rows of W (nf4_chunks.h: 16 MiB, or more until a chunk's GEMM fills
// the GPU) are dequantized into one buffer and multiplied one after the other; grad_x sums the chunks
// in an fp32 buffer and is rounded once. The base weight's GEMM dy W (and x W^T under
// PYKERNELS_SM90_LORA=cublas) runs on cuBLAS through ATen, which measured twice as fast as our
// 128x128 tiles (base_gemm); the tensor-core products with an
// fp32 output (xa, dxa, NF4's dy W) run on the sm_90a core on Hopper (bf16, common/gemm_sm90_torch.h),
// else on the sm80 GEMM (common/gemm_sm80.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/env_knob.h"
#include "common/gemm_sm90_torch.h"
#include "lora/lora.h"
#include "lora/lora_extended_k.h"
#include "lora/lora_rank_pieces.h"
#include "lora/lora_torch_checks.h"
#include "lora/nf4_chunks.h"
#include "nf4/nf4.h"
#include "nf4/nf4_gemm_sm90.h"

namespace pykernels::lora {
namespace {

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, error); }

cudaStream_t current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

DType dtype_of(const at::Tensor& t) { return float_dtype(t.scalar_type(), "tensor"); }

// t itself when it already has dtype, else a converted copy (the fp32 dA / dB to A's / B's dtype).
at::Tensor cast_to(const at::Tensor& t, at::ScalarType dtype, cudaStream_t stream) {
  if (t.scalar_type() == dtype) return t;
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(dtype));
  check_launch(launch_cast(t.data_ptr(), dtype_of(t), out.data_ptr(), dtype_of(out), t.numel(), stream));
  return out;
}

// A GEMM operand as stored: row-major with `ld` elements between rows; transposed means op(X) = X^T.
struct Operand {
  const void* data;
  int64_t ld;
  bool transposed;
};
Operand plain(const at::Tensor& t) { return {t.data_ptr(), t.size(1), false}; }
Operand transposed(const at::Tensor& t) { return {t.data_ptr(), t.size(1), true}; }

struct Output {
  void* data;  // [m, n] row-major
  int64_t ld;
  DType dtype;
};
Output output(const at::Tensor& t) { return {t.data_ptr(), t.size(1), dtype_of(t)}; }

// out = alpha * op(a) @ op(b) (+ out when accumulate), op(a) [m, k], op(b) [k, n].
void gemm(int64_t m, int64_t n, int64_t k, Operand a, Operand b, DType ab_dtype, Output out, float alpha,
          bool accumulate, cudaStream_t stream) {
  gemm::GemmParams p{};
  p.m = m;
  p.n = n;
  p.k = k;
  p.a = a.data;
  p.lda = a.ld;
  p.a_transposed = a.transposed;
  p.b = b.data;
  p.ldb = b.ld;
  p.b_transposed = b.transposed;
  p.c = accumulate ? out.data : nullptr;  // in place: C aliases D
  p.ldc = out.ld;
  p.d = out.data;
  p.ldd = out.ld;
  p.ab_dtype = ab_dtype;
  p.d_dtype = out.dtype;
  p.alpha = alpha;
  p.beta = accumulate ? 1.0f : 0.0f;
  gemm::run_gemm(p, stream);  // the sm_90a core on Hopper (bf16), else gemm::launch_gemm (sm80)
}

// out (+)= a @ b for the base weight's GEMMs (x W^T forward, dy W backward), all in x's dtype: on
// cuBLAS through ATen. Measured on an H100 (benchmarks/results/h100.md, kernel breakdown) at T 8192
// on a 4096 x 14336 weight: 1.19 ms for x W^T against 2.23 ms on our sm_90a core and 2.24 ms on
// the sm80 kernel. beta = 1 accumulates in fp32 before the one rounding, as our kernels do.
void base_gemm(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (accumulate) {
    out.addmm_(a, b);
  } else {
    at::mm_out(out, a, b);
  }
}

// The rows of an NF4 weight [n, k], dequantized a chunk at a time (nf4_chunks.h) into one buffer of
// x's dtype.
// The dequantize launcher starts at a block boundary (and, with double quantization, at a nested
// block boundary), so a chunk is decoded from the boundary at or before its first row; the slack
// before the row is at most one such group.
class Nf4RowChunks {
 public:
  Nf4RowChunks(const nf4::DequantizeParams& weight, int64_t n, int64_t k, const at::Tensor& x)
      : weight_(weight), k_(k) {
    const bool nested = weight.scales.absmax == nullptr;
    group_ = weight.blocksize * (nested ? weight.scales.nested_blocksize : 1);
    const int64_t cap_bytes = env_knob<int64_t>("PYKERNELS_NF4_CHUNK_MIB", nf4_chunk_cap_for);
    const int64_t m = x.numel() / k;  // x [..., k]: the tokens of the GEMM
    rows_per_chunk_ = nf4_chunk_rows(n, k, m, x.element_size(), device_multiprocessors(x.get_device()), cap_bytes);
    buffer_ = at::empty({rows_per_chunk_ * k + group_}, x.options());
    weight_.out_dtype = dtype_of(x);
  }

  int64_t rows_per_chunk() const { return rows_per_chunk_; }

  // Dequantizes rows [row, row + rows) and returns them as a [rows, k] view of the buffer.
  at::Tensor dequantize(int64_t row, int64_t rows, cudaStream_t stream) {
    const int64_t first = row * k_;
    const int64_t start = first - first % group_;  // a multiple of blocksize (and nested block)
    const int64_t block = start / weight_.blocksize;
    nf4::DequantizeParams part = weight_;
    part.packed = weight_.packed + start / 2;  // blocksize is even: start is a whole byte
    if (weight_.scales.absmax != nullptr) {
      part.scales.absmax = weight_.scales.absmax + block;
    } else {
      part.scales.absmax_q = weight_.scales.absmax_q + block;
      part.scales.nested_absmax = weight_.scales.nested_absmax + block / weight_.scales.nested_blocksize;
    }
    part.numel = first + rows * k_ - start;
    part.out = buffer_.data_ptr();
    check_launch(nf4::launch_dequantize(part, stream));
    return buffer_.narrow(0, first - start, rows * k_).view({rows, k_});
  }

 private:
  nf4::DequantizeParams weight_;
  int64_t k_;
  int64_t group_;
  int64_t rows_per_chunk_;
  at::Tensor buffer_;
};

// A matrix operand of launch_rank_gemm: op(X)[row, col] = data[row * stride_row + col * stride_col].
struct RankOperand {
  const void* data;
  DType dtype;
  int64_t stride_row, stride_col;
};
RankOperand rows_of(const at::Tensor& t) { return {t.data_ptr(), dtype_of(t), t.size(1), 1}; }  // t itself
RankOperand columns_of(const at::Tensor& t) { return {t.data_ptr(), dtype_of(t), 1, t.size(1)}; }  // t^T

// out (+)= alpha * a @ b, a [m, k], b [k, n], each in its own dtype, fp32 sums, one rounding to out's dtype.
void rank_gemm(int64_t m, int64_t n, int64_t k, RankOperand a, RankOperand b, at::Tensor& out, float alpha,
               bool accumulate, cudaStream_t stream) {
  RankGemmParams p{};
  p.m = m, p.n = n, p.k = k;
  p.a = a.data, p.a_dtype = a.dtype, p.a_stride_m = a.stride_row, p.a_stride_k = a.stride_col;
  p.b = b.data, p.b_dtype = b.dtype, p.b_stride_k = b.stride_row, p.b_stride_n = b.stride_col;
  p.d = out.data_ptr(), p.d_dtype = dtype_of(out), p.ldd = out.size(1);
  p.alpha = alpha, p.accumulate = accumulate;
  p.sms = device_multiprocessors(out.get_device());
  at::Tensor workspace;  // the split-k planes (lora.h, rank_gemm_split), freed when the launch is queued
  if (const int64_t floats = rank_gemm_workspace_floats(p); floats > 0) {
    workspace = at::empty({floats}, out.options().dtype(at::kFloat));
    p.workspace = workspace.data_ptr<float>();
  }
  check_launch(launch_rank_gemm(p, stream));
}

// With bf16 x and PYKERNELS_LORA_RANK_GEMM=tensor_core (the default) the rank products that meet an
// fp32 factor run as bf16 pieces on the tensor-core GEMM (lora_rank_pieces.h) instead of rank_gemm.
bool rank_on_tensor_cores(const at::Tensor& x) {
  const bool simt = env_knob<bool>("PYKERNELS_LORA_RANK_GEMM", lora_rank_gemm_for);
  return !simt && x.scalar_type() == at::kBFloat16;
}

// t (contiguous [l.rows, l.cols], fp32 or 16-bit) as bf16 pieces laid out as l.
at::Tensor pieces_of(const at::Tensor& t, const PieceLayout& l, cudaStream_t stream) {
  const auto shape = l.stacked ? std::vector<int64_t>{l.blocks * l.rows, l.cols}
                               : std::vector<int64_t>{l.rows, l.blocks * l.cols};
  at::Tensor out = at::empty(shape, t.options().dtype(at::kBFloat16));
  check_launch(launch_split_pieces(t.data_ptr(), dtype_of(t), l, out.data_ptr(), stream));
  return out;
}

// alpha op(a) op(b) ([m, n], fp32, bf16 pieces in one operand: three blocks laid out as `sum`) with
// the blocks added, [sum.rows, sum.cols] of dtype.
at::Tensor summed_product(int64_t m, int64_t n, int64_t k, Operand a, Operand b, float alpha, const PieceLayout& sum,
                          at::ScalarType dtype, const at::Tensor& like, cudaStream_t stream) {
  at::Tensor product = at::empty({m, n}, like.options().dtype(at::kFloat));
  gemm(m, n, k, a, b, DType::kBFloat16, output(product), alpha, false, stream);
  at::Tensor out = at::empty({sum.rows, sum.cols}, like.options().dtype(dtype));
  check_launch(launch_sum_pieces(product.data_ptr<float>(), sum, out.data_ptr(), dtype_of(out), stream));
  return out;
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " must be on ", x.device(), " like x, got ", t.device());
}

// Checks the backward-only inputs beyond check_backward (shared with the CPU): the GEMMs with dy
// need x's dtype.
void check_cuda_backward(const at::Tensor& grad_y, const at::Tensor& xa, const at::Tensor& x) {
  check_same_device(grad_y, "grad_y", x);
  check_same_device(xa, "xa", x);
  TORCH_CHECK_VALUE(grad_y.scalar_type() == x.scalar_type(), "grad_y must have x's dtype ", x.scalar_type(),
                    ", got ", grad_y.scalar_type());
}

// xa = x_lora A^T (fp32).
at::Tensor lora_down(const at::Tensor& x, const at::Tensor& x_lora, const at::Tensor& lora_A, const Shapes& s,
                     cudaStream_t stream) {
  if (lora_A.scalar_type() != x.scalar_type() && rank_on_tensor_cores(x)) {  // x [A_hi; A_mid; A_lo]^T
    const at::Tensor a3 = pieces_of(lora_A, three_pieces(s.r, s.k, /*stacked=*/true), stream);
    return summed_product(s.m, 3 * s.r, s.k, plain(x_lora), transposed(a3), 1.0f, three_pieces(s.m, s.r, false),
                          at::kFloat, x, stream);
  }
  at::Tensor xa = at::empty({s.m, s.r}, x.options().dtype(at::kFloat));
  if (lora_A.scalar_type() == x.scalar_type()) {  // one input dtype: the tensor-core GEMM
    gemm(s.m, s.r, s.k, plain(x_lora), transposed(lora_A), dtype_of(x), output(xa), 1.0f, false, stream);
  } else {  // fp32 A against 16-bit x: fp32 math throughout
    rank_gemm(s.m, s.r, s.k, rows_of(x_lora), columns_of(lora_A), xa, 1.0f, false, stream);
  }
  return xa;
}

// xa = x_lora A^T (fp32), and y filled with the LoRA term scaling xa B^T + bias in x's dtype.
std::tuple<at::Tensor, at::Tensor> start_forward(const at::Tensor& x, const at::Tensor& x_lora,
                                                 const at::Tensor& lora_A, const at::Tensor& lora_B,
                                                 double scaling, const std::optional<at::Tensor>& bias,
                                                 const Shapes& s, cudaStream_t stream) {
  at::Tensor xa = lora_down(x, x_lora, lora_A, s, stream);
  at::Tensor y = at::empty({s.m, s.n}, x.options());
  LowRankParams term{};
  term.m = s.m;
  term.n = s.n;
  term.r = s.r;
  term.xa = xa.data_ptr<float>();
  term.b = lora_B.data_ptr();
  term.b_dtype = dtype_of(lora_B);
  term.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  term.scaling = static_cast<float>(scaling);
  term.out = y.data_ptr();
  term.out_dtype = dtype_of(y);
  check_launch(launch_low_rank_term(term, stream));
  return {y, xa};
}

// The Hopper GEMMs with the LoRA term as extra K (lora/lora_extended_k.h), when the knob of `use`
// asks for them (the forward's by default) and they can run here: bf16 x, Hopper, m >= 1 and the
// 16-byte rows TMA needs. Else nothing is allocated and the caller runs the cuBLAS path.
//   forward   y = [x | U] [W | V]^T: U from scaling xa, V from B and the bias (one group, K-major W)
//   grad_x    grad_x = dy W + dxa A = [dy | U] [W ; V^T]: U from dxa, V from A^T, transposed to
//             the N-major layout W has in this product (dense W, no x_lora: the term goes to grad_x)
class ExtendedKGemm {
 public:
  enum class Use { kForward, kGradX };

  static std::optional<ExtendedKGemm> make(const at::Tensor& x, const Shapes& s, Use use) {
    const bool wanted = use == Use::kForward
                            ? !env_knob<bool>("PYKERNELS_SM90_LORA", lora_sm90_forward_for)  // true: cuBLAS
                            : env_knob<bool>("PYKERNELS_SM90_LORA_GRAD_X", lora_sm90_grad_x_for);
    if (!wanted || x.scalar_type() != at::kBFloat16 || s.m < 1 || s.k < 1 || s.n < 1 || s.k % 8 != 0 ||
        s.n % 8 != 0 || !gemm::sm90_usable(x.get_device()) || !is_aligned(x.data_ptr(), 16))
      return std::nullopt;
    return ExtendedKGemm();
  }

  // y [m, n] (a new tensor) and xa: y = x W^T + the LoRA term and bias, W's rows in chunks of
  // `weight_rows(row, rows)` (a [rows, k] bf16 tensor) when W is NF4, else one.
  template <class WeightRows>
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& x_lora, const at::Tensor& lora_A,
                                             const at::Tensor& lora_B, double scaling,
                                             const std::optional<at::Tensor>& bias, const Shapes& s,
                                             int64_t chunk_rows, WeightRows&& weight_rows, cudaStream_t stream) const {
    at::Tensor xa = lora_down(x, x_lora, lora_A, s, stream);
    const ExtendedK layout = extended_k(s.r, lora_B.scalar_type() == at::kFloat, bias.has_value());
    auto [u, v] = operands(layout, xa, static_cast<float>(scaling), lora_B, bias, s.m, s.n, stream);
    at::Tensor y = at::empty({s.m, s.n}, x.options());
    for (int64_t row = 0; row < s.n; row += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, s.n - row);
      const at::Tensor w = weight_rows(row, rows);
      gemm::GroupedGemmSm90Params g{};  // y[:, row:] = [x | U] [W[rows] | V[rows]]^T, one group
      g.kind = gemm::Sm90GemmKind::kRowsKMajorB;
      g.slots = s.m, g.experts = 1, g.n = rows, g.k = s.k;
      g.a = x.data_ptr(), g.lda = s.k;
      g.b = w.data_ptr(), g.ldb = w.stride(0);
      g.d = y.select(1, row).data_ptr(), g.ldd = s.n, g.d_dtype = DType::kBFloat16, g.alpha = 1.0f;
      g.a2 = u.data_ptr(), g.lda2 = layout.width, g.k2 = layout.width;
      g.b2 = v[row].data_ptr(), g.ldb2 = layout.width;
      gemm::run_grouped_gemm_sm90(g, x.get_device(), stream);
    }
    return {y, xa};
  }

  // grad_x [m, k] (a new tensor in dy's dtype) = dy W + dxa A, dense W.
  at::Tensor grad_x(const at::Tensor& grad_y, const at::Tensor& weight, const at::Tensor& dxa,
                    const at::Tensor& lora_A, const Shapes& s, cudaStream_t stream) const {
    const ExtendedK layout = extended_k(s.r, lora_A.scalar_type() == at::kFloat, false);
    auto [u, v] = operands(layout, dxa, 1.0f, lora_A.t().contiguous(), std::nullopt, s.m, s.k, stream);
    const at::Tensor v_rows = v.t().contiguous();  // [width, k]: N-major like W in dy W
    at::Tensor grad_x = at::empty({s.m, s.k}, grad_y.options());
    gemm::GroupedGemmSm90Params g{};
    g.kind = gemm::Sm90GemmKind::kRowsNMajorB;
    g.slots = s.m, g.experts = 1, g.n = s.k, g.k = s.n;
    g.a = grad_y.data_ptr(), g.lda = s.n;
    g.b = weight.data_ptr(), g.ldb = s.k;
    g.d = grad_x.data_ptr(), g.ldd = s.k, g.d_dtype = DType::kBFloat16, g.alpha = 1.0f;
    g.a2 = u.data_ptr(), g.lda2 = layout.width, g.k2 = layout.width;
    g.b2 = v_rows.data_ptr(), g.ldb2 = s.k;
    gemm::run_grouped_gemm_sm90(g, grad_y.get_device(), stream);
    return grad_x;
  }

 private:
  // U [rows_u, width] from `left` (fp32 [rows_u, r], times scaling) and V [rows_v, width] from
  // `right` ([rows_v, r]) and the bias: lora_extended_k.h's packing, on the device.
  static std::pair<at::Tensor, at::Tensor> operands(const ExtendedK& layout, const at::Tensor& left, float scaling,
                                                    const at::Tensor& right, const std::optional<at::Tensor>& bias,
                                                    int64_t rows_u, int64_t rows_v, cudaStream_t stream) {
    const auto bf16 = left.options().dtype(at::kBFloat16);
    at::Tensor u = at::empty({rows_u, layout.width}, bf16), v = at::empty({rows_v, layout.width}, bf16);
    ExtendedKOperandsParams p{layout, rows_u, rows_v, left.data_ptr<float>(), scaling, right.data_ptr(),
                              dtype_of(right), bias.has_value() ? bias->data_ptr() : nullptr, u.data_ptr(),
                              v.data_ptr()};
    check_launch(launch_extended_k_operands(p, stream));
    return {u, v};
  }
};

std::tuple<at::Tensor, at::Tensor> lora_linear_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                                                    const std::optional<at::Tensor>& bias,
                                                    const std::optional<at::Tensor>& x_lora) {
  check_dense_weight(weight, x);
  const Shapes s = check_lora_inputs(x, weight.size(0), lora_A, lora_B, bias, x_lora);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  const auto extended = ExtendedKGemm::make(x, s, ExtendedKGemm::Use::kForward);
  if (extended && is_aligned(weight.data_ptr(), 16))
    return extended->forward(x, x_lora.value_or(x), lora_A, lora_B, scaling, bias, s, s.n,
                             [&](int64_t, int64_t) { return weight; }, stream);
  auto [y, xa] = start_forward(x, x_lora.value_or(x), lora_A, lora_B, scaling, bias, s, stream);
  base_gemm(y, x, weight.t(), /*accumulate=*/true);
  return {y, xa};
}

// The QLoRA forward's x W^T with the NF4 decode in the GEMM's mainloop (nf4/nf4_gemm_sm90.h), when
// PYKERNELS_SM90_NF4=mainloop asks for it and it can run here: bf16 x, Hopper, and the blocks,
// sizes and alignment the kernel needs. Else nothing is launched and the caller dequantizes.
class Nf4MainloopForward {
 public:
  static std::optional<Nf4MainloopForward> make(const at::Tensor& x, const at::Tensor& packed, int64_t blocksize,
                                                const Shapes& s) {
    const bool wanted = env_knob<bool>("PYKERNELS_SM90_NF4", nf4::nf4_sm90_forward_for);
    if (!wanted || x.scalar_type() != at::kBFloat16 || !nf4::nf4_gemm_sm90_built() ||
        !gemm::sm90_usable(x.get_device()))
      return std::nullopt;
    nf4::Nf4GemmSm90Params p{};
    p.m = s.m, p.n = s.n, p.k = s.k, p.blocksize = blocksize;
    p.x = x.data_ptr(), p.packed = packed.data_ptr<uint8_t>();
    p.scales = x.data_ptr(), p.y = x.data_ptr();  // stand-ins: both are allocated in run (16-byte aligned)
    if (nf4::nf4_gemm_sm90_error(p) != nullptr) return std::nullopt;
    return Nf4MainloopForward(p);
  }

  // y += x W^T; the kernel's scale operand, every block's absmax in fp32 [k / blocksize, n], comes
  // from one launch (a double-quantized absmax decoded as the dequantize kernel decodes it).
  void run(at::Tensor& y, const nf4::BlockScales& block_scales, cudaStream_t stream) const {
    const int64_t groups = params_.k / params_.blocksize;
    at::Tensor scales = at::empty({groups, params_.n}, y.options().dtype(at::kFloat));
    check_launch(nf4::launch_transposed_scales({block_scales, params_.n, groups, scales.data_ptr<float>()}, stream));
    nf4::Nf4GemmSm90Params p = params_;
    p.scales = scales.data_ptr(), p.y = y.data_ptr(), p.beta = 1.0f;
    const int device = y.get_device();
    const at::Tensor workspace = gemm::sm90_workspace(nf4::nf4_gemm_sm90_workspace_bytes(p, device), device);
    check_launch(nf4::run_nf4_gemm_sm90(p, workspace.data_ptr(), device, stream));
  }

 private:
  explicit Nf4MainloopForward(const nf4::Nf4GemmSm90Params& params) : params_(params) {}

  nf4::Nf4GemmSm90Params params_;
};

std::tuple<at::Tensor, at::Tensor> lora_linear_nf4_cuda(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize, int64_t out_features,
    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& x_lora, const std::optional<at::Tensor>& nested_absmax,
    const std::optional<at::Tensor>& nested_code, const std::optional<at::Tensor>& nested_offset,
    int64_t nested_blocksize) {
  const Shapes s = check_lora_inputs(x, out_features, lora_A, lora_B, bias, x_lora);
  const nf4::DequantizeParams weight = nf4_weight_params(packed, absmax, blocksize, s.n, s.k, nested_absmax,
                                                         nested_code, nested_offset, nested_blocksize, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  if (const auto mainloop = Nf4MainloopForward::make(x, packed, blocksize, s)) {
    auto [y, xa] = start_forward(x, x_lora.value_or(x), lora_A, lora_B, scaling, bias, s, stream);
    mainloop->run(y, weight.scales, stream);
    return {y, xa};
  }
  if (const auto extended = ExtendedKGemm::make(x, s, ExtendedKGemm::Use::kForward)) {
    Nf4RowChunks chunks(weight, s.n, s.k, x);  // y[:, rows] = [x | U] [W[rows] | V[rows]]^T per chunk
    return extended->forward(x, x_lora.value_or(x), lora_A, lora_B, scaling, bias, s, chunks.rows_per_chunk(),
                             [&](int64_t row, int64_t rows) { return chunks.dequantize(row, rows, stream); },
                             stream);
  }
  auto [y, xa] = start_forward(x, x_lora.value_or(x), lora_A, lora_B, scaling, bias, s, stream);
  if (s.m == 0) return {y, xa};
  // y[:, rows] += x W[rows]^T, into a column slice of y (row stride n).
  Nf4RowChunks chunks(weight, s.n, s.k, x);
  for (int64_t row = 0; row < s.n; row += chunks.rows_per_chunk()) {
    const int64_t rows = std::min(chunks.rows_per_chunk(), s.n - row);
    base_gemm(y.narrow(1, row, rows), x, chunks.dequantize(row, rows, stream).t(), /*accumulate=*/true);
  }
  return {y, xa};
}

// Everything but dy @ W: grad_A, grad_B and the LoRA part of the input gradient. Without x_lora,
// grad_x (when computed, allocated here in grad_x_dtype: x's, or fp32 for a sum over NF4 chunks)
// is set to dxa A, and the caller then adds dy W in place. Every product that meets an fp32 operand
// (B, xa, dxa, A) is a rank_gemm: fp32 math, no 16-bit copy of a LoRA weight or intermediate; or,
// under PYKERNELS_LORA_RANK_GEMM=tensor_core, a tensor-core GEMM of its bf16 pieces.
struct LowRankGrads {
  at::Tensor grad_x, grad_x_lora, grad_A, grad_B;
  at::Tensor dxa;  // scaling dy B, fp32 [m, r]
};

LowRankGrads low_rank_backward(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& lora_A,
                               const at::Tensor& lora_B, const at::Tensor& xa, double scaling,
                               const std::optional<at::Tensor>& x_lora, bool compute_grad_x,
                               at::ScalarType grad_x_dtype, const Shapes& s, cudaStream_t stream) {
  const float scale = static_cast<float>(scaling);
  const auto f32 = x.options().dtype(at::kFloat);
  const at::Tensor& lora_input = x_lora.value_or(x);
  const bool pieces = rank_on_tensor_cores(x);
  const PieceLayout by_rank_m = three_pieces(s.m, s.r, /*stacked=*/false);  // [M, 3r]: xa's, dxa's

  at::Tensor dxa;
  if (lora_B.scalar_type() == x.scalar_type()) {  // one input dtype: the tensor-core GEMM
    dxa = at::empty({s.m, s.r}, f32);
    gemm(s.m, s.r, s.n, plain(grad_y), plain(lora_B), dtype_of(x), output(dxa), scale, false, stream);
  } else if (pieces) {  // dy [B_hi | B_mid | B_lo]
    const at::Tensor b3 = pieces_of(lora_B, three_pieces(s.n, s.r, false), stream);
    dxa = summed_product(s.m, 3 * s.r, s.n, plain(grad_y), plain(b3), scale, by_rank_m, at::kFloat, x, stream);
  } else {
    dxa = at::empty({s.m, s.r}, f32);
    rank_gemm(s.m, s.r, s.n, rows_of(grad_y), rows_of(lora_B), dxa, scale, false, stream);
  }
  at::Tensor grad_B, grad_A;
  if (pieces) {
    const at::Tensor xa3 = pieces_of(xa, by_rank_m, stream);  // dB = s dy^T [xa_hi | xa_mid | xa_lo]
    grad_B = summed_product(s.n, 3 * s.r, s.m, transposed(grad_y), plain(xa3), scale, three_pieces(s.n, s.r, false),
                            lora_B.scalar_type(), x, stream);
    const at::Tensor dxa3 = pieces_of(dxa, by_rank_m, stream);  // dA = [dxa_hi | dxa_mid | dxa_lo]^T x
    grad_A = summed_product(3 * s.r, s.k, s.m, transposed(dxa3), plain(lora_input), 1.0f,
                            three_pieces(s.r, s.k, /*stacked=*/true), lora_A.scalar_type(), x, stream);
  } else {
    grad_B = at::empty({s.n, s.r}, f32);
    rank_gemm(s.n, s.r, s.m, columns_of(grad_y), rows_of(xa), grad_B, scale, false, stream);  // s dy^T xa
    grad_A = at::empty({s.r, s.k}, f32);
    rank_gemm(s.r, s.k, s.m, columns_of(dxa), rows_of(lora_input), grad_A, 1.0f, false, stream);  // dxa^T x
    grad_B = cast_to(grad_B, lora_B.scalar_type(), stream);
    grad_A = cast_to(grad_A, lora_A.scalar_type(), stream);
  }

  LowRankGrads grads{at::empty({0}, x.options()), at::empty({0}, x.options()), grad_A, grad_B, dxa};
  const bool lora_term_needed = x_lora.has_value() || compute_grad_x;
  if (!lora_term_needed) return grads;
  at::Tensor& target = x_lora.has_value() ? grads.grad_x_lora : grads.grad_x;
  target = at::empty({s.m, s.k}, x_lora.has_value() ? x.options() : x.options().dtype(grad_x_dtype));
  if (pieces) {  // dxa A: six piece products as extra K of one GEMM
    const at::Tensor u = pieces_of(dxa, dxa_term_pieces(s.m, s.r), stream);     // [M, 6r]
    const at::Tensor v = pieces_of(lora_A, a_term_pieces(s.r, s.k), stream);   // [6r, K]
    gemm(s.m, s.k, 6 * s.r, plain(u), plain(v), DType::kBFloat16, output(target), 1.0f, false, stream);
  } else {
    rank_gemm(s.m, s.k, s.r, rows_of(dxa), rows_of(lora_A), target, 1.0f, false, stream);  // dxa A
  }
  if (x_lora.has_value() && compute_grad_x) grads.grad_x = at::empty({s.m, s.k}, x.options().dtype(grad_x_dtype));
  return grads;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
    const at::Tensor& lora_B, const at::Tensor& xa, double scaling, const std::optional<at::Tensor>& x_lora,
    bool compute_grad_x) {
  check_dense_weight(weight, x);
  const Shapes s = check_lora_inputs(x, weight.size(0), lora_A, lora_B, std::nullopt, x_lora);
  check_backward(grad_y, xa, s);
  check_cuda_backward(grad_y, xa, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  const auto extended = ExtendedKGemm::make(x, s, ExtendedKGemm::Use::kGradX);
  if (extended && compute_grad_x && !x_lora.has_value() && is_aligned(weight.data_ptr(), 16) &&
      is_aligned(grad_y.data_ptr(), 16)) {  // grad_x = [dy | U] [W ; V^T], one GEMM
    LowRankGrads g = low_rank_backward(grad_y, x, lora_A, lora_B, xa, scaling, x_lora, /*compute_grad_x=*/false,
                                       x.scalar_type(), s, stream);
    return {extended->grad_x(grad_y, weight, g.dxa, lora_A, s, stream), g.grad_x_lora, g.grad_A, g.grad_B};
  }
  LowRankGrads g =
      low_rank_backward(grad_y, x, lora_A, lora_B, xa, scaling, x_lora, compute_grad_x, x.scalar_type(), s, stream);
  if (compute_grad_x) {
    // grad_x = dy W (+ dxa A already in grad_x when x_lora is absent).
    base_gemm(g.grad_x, grad_y, weight, /*accumulate=*/!x_lora.has_value());
  }
  return {g.grad_x, g.grad_x_lora, g.grad_A, g.grad_B};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_nf4_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
    int64_t blocksize, const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& xa, double scaling,
    const std::optional<at::Tensor>& x_lora, bool compute_grad_x, const std::optional<at::Tensor>& nested_absmax,
    const std::optional<at::Tensor>& nested_code, const std::optional<at::Tensor>& nested_offset,
    int64_t nested_blocksize) {
  const Shapes s = check_lora_inputs(x, lora_B.dim() == 2 ? lora_B.size(0) : -1, lora_A, lora_B, std::nullopt, x_lora);
  check_backward(grad_y, xa, s);
  check_cuda_backward(grad_y, xa, x);
  std::optional<nf4::DequantizeParams> weight;
  if (compute_grad_x)
    weight = nf4_weight_params(packed, absmax, blocksize, s.n, s.k, nested_absmax, nested_code, nested_offset,
                               nested_blocksize, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = current_stream(x);
  // grad_x sums over the chunks in fp32 and is rounded once at the end: rounding the running sum
  // after every chunk would add one 16-bit rounding per chunk (8 for a 4096 x 14336 bf16 weight).
  LowRankGrads g =
      low_rank_backward(grad_y, x, lora_A, lora_B, xa, scaling, x_lora, compute_grad_x, at::kFloat, s, stream);
  if (compute_grad_x && x_lora.has_value() && (s.m == 0 || s.n == 0)) g.grad_x.zero_();  // dy W is empty
  if (compute_grad_x && s.m > 0) {
    // grad_x (+)= dy[:, rows] W[rows], accumulated in fp32 over the chunks of rows of W.
    Nf4RowChunks chunks(*weight, s.n, s.k, x);
    for (int64_t row = 0; row < s.n; row += chunks.rows_per_chunk()) {
      const int64_t rows = std::min(chunks.rows_per_chunk(), s.n - row);
      const Operand w_rows = plain(chunks.dequantize(row, rows, stream));
      const Operand dy_columns{static_cast<const char*>(grad_y.data_ptr()) + row * grad_y.element_size(), s.n, false};
      const bool accumulate = row > 0 || !x_lora.has_value();
      gemm(s.m, s.k, rows, dy_columns, w_rows, dtype_of(x), output(g.grad_x), 1.0f, accumulate, stream);
    }
  }
  if (compute_grad_x) g.grad_x = g.grad_x.to(x.scalar_type());
  return {g.grad_x, g.grad_x_lora, g.grad_A, g.grad_B};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("lora_linear", &lora_linear_cuda);
  m.impl("lora_linear_nf4", &lora_linear_nf4_cuda);
  m.impl("lora_linear_backward", &lora_linear_backward_cuda);
  m.impl("lora_linear_nf4_backward", &lora_linear_nf4_backward_cuda);
}

}  // namespace pykernels::lora
