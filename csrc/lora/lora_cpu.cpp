// CPU implementation of the fused LoRA ops (schemas in csrc/torch_bindings.cpp).
//
// The big products (x W^T, dy W) go to torch's BLAS, which is near the machine's peak; BLAS runs
// LoRA's skinny rank-r products at a few percent of peak, so those are our kernels
// (lora_cpu_kernels.cpp), fused around the GEMMs so LoRA costs one extra pass over each large
// tensor at most:
//   - x (or dy) is read one chunk of rows at a time, converted to fp32 in cache, so xa = x A^T
//     and dxa = s dy B are exact fp32 without an fp32 copy of x or dy;
//   - dB = s dy^T xa is reduced in the same pass over dy as dxa (per-thread partial sums);
//   - the LoRA term (and bias) is written to y / grad_x first, summed in fp32 and rounded once, and
//     the base GEMM then accumulates onto it (BLAS with beta = 1 reads its output almost for free;
//     a pass over y after the GEMM cost ~10% of it). PEFT rounds the base product, the LoRA term
//     and their sum; this rounds the LoRA term and the sum.
// With an NF4 weight, a chunk of rows of W is dequantized into a buffer and multiplied at a time
// (for grad_x = dy W a block of columns of W, so that each element is summed by one GEMM).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/cpu_isa.h"
#include "lora/lora_torch_checks.h"
#include "lora/lora_cpu_kernels.h"
#include "nf4/nf4_cpu_kernels.h"

namespace pykernels::lora {
namespace {

// Worker threads of at::parallel_for do not inherit the caller's "below autograd" dispatch state,
// so ATen calls made there would re-enter autograd (and reject out= ops on tensors that require
// grad). Every parallel body starts with this guard.
using BelowAutograd = at::AutoDispatchBelowADInplaceOrView;

constexpr int64_t kRowChunk = 64;  // rows of x / dy per task: a few hundred KB in fp32, stays in cache
constexpr int64_t kWeightChunkBytes = int64_t{8} << 20;  // dequantized NF4 rows per GEMM

at::Tensor to_float(const at::Tensor& t) { return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat); }

DType kernel_dtype(const at::Tensor& t) { return float_dtype(t.scalar_type(), "tensor"); }

const char* row_bytes(const at::Tensor& t, int64_t row) {
  return static_cast<const char*>(t.data_ptr()) + row * t.size(1) * t.element_size();
}

// Rows [begin, end) of a contiguous 2-D tensor as fp32 for reading: the rows themselves when fp32,
// else converted into this thread's scratch buffer (reused across calls: no allocation per chunk,
// which on CPU means no page faults per chunk either).
const float* input_rows(const at::Tensor& t, int64_t begin, int64_t end) {
  if (t.scalar_type() == at::kFloat) return reinterpret_cast<const float*>(row_bytes(t, begin));
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>((end - begin) * t.size(1)));
  cpu::to_fp32(row_bytes(t, begin), kernel_dtype(t), (end - begin) * t.size(1), scratch.data());
  return scratch.data();
}

// One zero-initialized fp32 accumulator per thread, summed at the end: reductions over rows
// without atomics or locks.
struct PerThreadSum {
  std::vector<at::Tensor> parts;
  PerThreadSum(int64_t rows, int64_t cols) {
    for (int t = 0; t < at::get_num_threads(); ++t) parts.push_back(at::zeros({rows, cols}, at::kFloat));
  }
  float* mine() { return parts[at::get_thread_num()].data_ptr<float>(); }
  at::Tensor total() const {
    at::Tensor sum = parts[0].clone();
    for (size_t t = 1; t < parts.size(); ++t) sum.add_(parts[t]);
    return sum;
  }
};

// xa = x_lora A^T in fp32 [M, r].
at::Tensor lora_down(const at::Tensor& x_lora, const at::Tensor& lora_A) {
  const at::Tensor a_t = to_float(lora_A).t().contiguous();  // [K, r]
  at::Tensor xa = at::empty({x_lora.size(0), lora_A.size(0)}, x_lora.options().dtype(at::kFloat));
  at::parallel_for(0, x_lora.size(0), kRowChunk, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    cpu::low_rank_down(input_rows(x_lora, begin, end), end - begin, x_lora.size(1), a_t.data_ptr<float>(),
                       a_t.size(1), xa.data_ptr<float>() + begin * a_t.size(1));
  });
  return xa;
}

// right_t fp32 [r, cols] in low_rank_up's packed layout: [ceil(cols / tile), r, tile], zero padded.
at::Tensor pack_column_tiles(const at::Tensor& right_t) {
  const int64_t r = right_t.size(0), cols = right_t.size(1);
  const int64_t tiles = (cols + cpu::kUpColumnTile - 1) / cpu::kUpColumnTile;
  return at::constant_pad_nd(right_t, {0, tiles * cpu::kUpColumnTile - cols})
      .view({r, tiles, cpu::kUpColumnTile})
      .permute({1, 0, 2})
      .contiguous();
}

// target = left @ right_t (+ bias), summed in fp32 and rounded once to target's dtype.
// left fp32 [M, r]; right_t fp32 [r, cols].
void write_low_rank(at::Tensor& target, const at::Tensor& left, const at::Tensor& right_t,
                    const std::optional<at::Tensor>& bias) {
  const at::Tensor packed = pack_column_tiles(right_t);
  const at::Tensor bias_f32 = bias.has_value() ? to_float(*bias).contiguous() : at::Tensor();
  at::parallel_for(0, target.size(0), kRowChunk, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    cpu::low_rank_up(const_cast<char*>(row_bytes(target, begin)), kernel_dtype(target), end - begin, target.size(1),
                     left.data_ptr<float>() + begin * left.size(1), left.size(1), packed.data_ptr<float>(),
                     bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr);
  });
}

// Whether base products of this dtype run in fp32. torch's 16-bit CPU GEMM has a vector path
// (oneDNN) only with AVX-512; without it, on 2 Zen 3 cores, a bf16 x W^T ran 20 GFLOP/s and
// dy W (4096 x 4096, 256 rows) 0.5 GFLOP/s (30 s), against ~110 GFLOP/s in fp32. The portable path
// therefore multiplies fp32 copies, a chunk of columns of the right operand at a time. Products of
// 16-bit values are exact in fp32 and both GEMMs sum in fp32, so only the summation order differs.
bool multiply_in_fp32(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && !uses_avx512(active_cpu_isa());
}

// Every base product below either overwrites its output or, with `accumulate`, is added onto it
// by BLAS itself (addmm, beta = 1): onto the LoRA term already written there, which costs the GEMM
// ~2% against ~10% for a separate pass over its output afterwards. In fp32 (multiply_in_fp32) the
// product of each chunk is added (or copied) onto out's columns, rounded once.
void dense_matmul(at::Tensor& out, const at::Tensor& left, const at::Tensor& right, bool accumulate) {
  if (multiply_in_fp32(out.scalar_type())) {
    const at::Tensor left_f32 = left.to(at::kFloat);
    const int64_t depth = std::max<int64_t>(1, right.size(0));
    const int64_t cols_per_chunk =
        std::min(right.size(1), std::max<int64_t>(1, kWeightChunkBytes / (depth * int64_t{sizeof(float)})));
    // One fp32 copy of a chunk of `right` (in right's own layout, so the copy reads it in order) and
    // one product, reused by every chunk: a fresh buffer of several MiB per chunk cost a page fault
    // per 4 KiB on every call (the LoRA forward at 4096 x 4096, 32 rows, on CI's Zen 3: 75 ms, now 30).
    const at::Tensor right_f32 = at::empty_like(right.narrow(1, 0, cols_per_chunk), right.options().dtype(at::kFloat));
    const at::Tensor product = at::empty({left.size(0), cols_per_chunk}, left_f32.options());
    for (int64_t col = 0; col < right.size(1); col += cols_per_chunk) {
      const int64_t cols = std::min(cols_per_chunk, right.size(1) - col);
      at::Tensor chunk = right_f32.narrow(1, 0, cols);
      chunk.copy_(right.narrow(1, col, cols));
      at::Tensor chunk_product = product.narrow(1, 0, cols);
      at::mm_out(chunk_product, left_f32, chunk);
      at::Tensor target = out.narrow(1, col, cols);
      if (accumulate) {
        target.add_(chunk_product);
      } else {
        target.copy_(chunk_product);
      }
    }
    return;
  }
  if (accumulate) {
    out.addmm_(left, right);
  } else {
    at::mm_out(out, left, right);
  }
}

// The left operand of a loop of dense_matmul calls into an output of `out_dtype`: its fp32 copy,
// made once, when those products run in fp32 (dense_matmul's own .to(kFloat) is then a no-op).
at::Tensor fp32_operand_once(const at::Tensor& left, at::ScalarType out_dtype) {
  return multiply_in_fp32(out_dtype) ? left.to(at::kFloat) : left;
}

// Dequantizes rows [row, row + rows) of an NF4 weight into buffer (in parallel).
void dequantize_rows(const nf4::DequantizeParams& weight, int64_t row, int64_t rows, int64_t k, at::Tensor& buffer) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    nf4::DequantizeParams part = weight;
    part.out = static_cast<char*>(buffer.data_ptr()) + begin * k * buffer.element_size();
    nf4::cpu::dequantize_range(part, (row + begin) * k, (row + end) * k);
  });
}

// y (+)= x @ W^T for an NF4 weight, a chunk of rows of W (columns of y) at a time, each chunk
// dequantized once into a buffer of the activation dtype.
void nf4_matmul_nt(const at::Tensor& x, nf4::DequantizeParams weight, int64_t out_features, at::Tensor& y,
                   bool accumulate) {
  const int64_t k = x.size(1);
  const int64_t rows_per_chunk = std::max<int64_t>(1, kWeightChunkBytes / (k * x.element_size()));
  at::Tensor buffer = at::empty({std::min(rows_per_chunk, out_features), k}, x.options());
  weight.out_dtype = float_dtype(x.scalar_type(), "x");
  const at::Tensor left = fp32_operand_once(x, y.scalar_type());
  for (int64_t row = 0; row < out_features; row += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, out_features - row);
    dequantize_rows(weight, row, rows, k, buffer);
    at::Tensor columns = y.narrow(1, row, rows);
    dense_matmul(columns, left, buffer.narrow(0, 0, rows).t(), accumulate);
  }
}

// Dequantizes columns [col, col + cols) of every row of an NF4 weight [rows, k] into buffer
// [rows, cols] (in parallel over rows).
void dequantize_columns(const nf4::DequantizeParams& weight, int64_t col, int64_t cols, int64_t rows, int64_t k,
                        at::Tensor& buffer) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    nf4::DequantizeParams part = weight;
    for (int64_t row = begin; row < end; ++row) {
      part.out = static_cast<char*>(buffer.data_ptr()) + row * cols * buffer.element_size();
      nf4::cpu::dequantize_range(part, row * k + col, row * k + col + cols);
    }
  });
}

// grad_x (+)= dy @ W for an NF4 weight, a block of columns of W (and of grad_x) at a time: each
// block is dequantized for all out_features rows and multiplied at full depth, so every element of
// grad_x is one GEMM's fp32 sum, rounded once. (Chunks of rows of W instead split that sum, and a
// 16-bit grad_x was re-rounded after every chunk: 15 times for a 4096 x 14336 weight.) Blocks are
// whole multiples of 64 columns, so NF4 blocks of 64 stay whole and take the vector path.
void nf4_matmul_nn(const at::Tensor& dy, nf4::DequantizeParams weight, int64_t out_features, at::Tensor& grad_x,
                   bool accumulate) {
  const int64_t k = grad_x.size(1);
  const int64_t fitting = kWeightChunkBytes / (out_features * grad_x.element_size());
  const int64_t cols_per_chunk = std::min(k, std::max<int64_t>(64, fitting / 64 * 64));
  at::Tensor buffer = at::empty({out_features * cols_per_chunk}, grad_x.options());
  weight.out_dtype = float_dtype(grad_x.scalar_type(), "grad_x");
  const at::Tensor left = fp32_operand_once(dy, grad_x.scalar_type());
  for (int64_t col = 0; col < k; col += cols_per_chunk) {
    const int64_t cols = std::min(cols_per_chunk, k - col);
    at::Tensor block = buffer.narrow(0, 0, out_features * cols).view({out_features, cols});
    dequantize_columns(weight, col, cols, out_features, k, block);
    at::Tensor target = grad_x.narrow(1, col, cols);
    dense_matmul(target, left, block, accumulate);
  }
}

// y = x W^T + s (x_lora A^T) B^T + bias, with `add_base(y, accumulate)` computing the base product.
// The LoRA term and bias go into y first (fp32 sums, rounded once to y's dtype), then the base
// GEMM accumulates onto them.
template <typename AddBase>
std::tuple<at::Tensor, at::Tensor> lora_forward(const at::Tensor& x, int64_t out_features, const at::Tensor& x_lora,
                                                const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                                                const std::optional<at::Tensor>& bias, AddBase add_base) {
  at::Tensor xa = lora_down(x_lora, lora_A);
  const at::Tensor bt = to_float(lora_B).mul(scaling).t().contiguous();  // [r, N], scaling folded in
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  write_low_rank(y, xa, bt, bias);
  if (x.size(0) > 0 && x.size(1) > 0) add_base(y, /*accumulate=*/true);
  return {y, xa};
}

std::tuple<at::Tensor, at::Tensor> lora_linear_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                   const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling,
                                                   const std::optional<at::Tensor>& bias,
                                                   const std::optional<at::Tensor>& x_lora) {
  check_dense_weight(weight, x);
  check_lora_inputs(x, weight.size(0), lora_A, lora_B, bias, x_lora);
  return lora_forward(x, weight.size(0), x_lora.value_or(x), lora_A, lora_B, scaling, bias,
                      [&](at::Tensor& y, bool accumulate) { dense_matmul(y, x, weight.t(), accumulate); });
}

std::tuple<at::Tensor, at::Tensor> lora_linear_nf4_cpu(
    const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize, int64_t out_features,
    const at::Tensor& lora_A, const at::Tensor& lora_B, double scaling, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& x_lora, const std::optional<at::Tensor>& nested_absmax,
    const std::optional<at::Tensor>& nested_code, const std::optional<at::Tensor>& nested_offset,
    int64_t nested_blocksize) {
  const Shapes s = check_lora_inputs(x, out_features, lora_A, lora_B, bias, x_lora);
  const nf4::DequantizeParams weight = nf4_weight_params(packed, absmax, blocksize, s.n, s.k, nested_absmax,
                                                         nested_code, nested_offset, nested_blocksize, x);
  return lora_forward(x, s.n, x_lora.value_or(x), lora_A, lora_B, scaling, bias,
                      [&](at::Tensor& y, bool accumulate) { nf4_matmul_nt(x, weight, s.n, y, accumulate); });
}

// Rank padded to whole 16-lane vectors for low_rank_backward: its rows of B and dB are r floats
// apart, and with a partial vector each masked store of a dB row overlaps the next row's load,
// which defeats store-to-load forwarding (r = 1..8 ran 2.5x slower than r = 16). Zero lanes cost
// nothing extra: a partial vector takes the same instructions as a full one.
constexpr int64_t kRankPadding = 16;

at::Tensor pad_rank(const at::Tensor& t, int64_t padded) {  // fp32 [rows, r] -> [rows, padded], zeros after r
  return t.size(1) == padded ? t.contiguous() : at::constant_pad_nd(t, {0, padded - t.size(1)});
}

// dxa = scaling * dy @ B and dB = scaling * dy^T @ xa, in one pass over dy.
std::tuple<at::Tensor, at::Tensor> low_rank_grads(const at::Tensor& grad_y, const at::Tensor& lora_B,
                                                  const at::Tensor& xa, double scaling) {
  const int64_t r = lora_B.size(1);
  const int64_t padded = (r + kRankPadding - 1) / kRankPadding * kRankPadding;
  const at::Tensor b = pad_rank(to_float(lora_B), padded);  // [N, padded]
  const at::Tensor xa_padded = pad_rank(xa, padded);         // [M, padded]
  at::Tensor dxa = at::empty({grad_y.size(0), padded}, grad_y.options().dtype(at::kFloat));
  PerThreadSum db(b.size(0), padded);
  at::parallel_for(0, grad_y.size(0), kRowChunk, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    cpu::low_rank_backward(input_rows(grad_y, begin, end), end - begin, grad_y.size(1), b.data_ptr<float>(),
                           xa_padded.data_ptr<float>() + begin * padded, padded, static_cast<float>(scaling),
                           dxa.data_ptr<float>() + begin * padded, db.mine());
  });
  if (padded == r) return {dxa, db.total()};
  return {dxa.narrow(1, 0, r).contiguous(), db.total().narrow(1, 0, r).contiguous()};
}

// dA = dxa^T @ x_lora (fp32, per-thread partial sums over rows).
at::Tensor lora_a_grad(const at::Tensor& dxa, const at::Tensor& x_lora) {
  const int64_t r = dxa.size(1);
  PerThreadSum da(r, x_lora.size(1));
  at::parallel_for(0, x_lora.size(0), kRowChunk, [&](int64_t begin, int64_t end) {
    const BelowAutograd below_autograd;
    cpu::lora_a_grad(input_rows(x_lora, begin, end), end - begin, x_lora.size(1), dxa.data_ptr<float>() + begin * r, r,
                     da.mine());
  });
  return da.total();
}

// Gradients of the LoRA op, with `add_base(grad_x, accumulate)` computing the base product dy @ W.
// Without a separate x_lora, grad_x = dy W + dxa A: the LoRA part is written first and the base
// GEMM accumulates onto it, as in the forward.
template <typename AddBase>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& lora_A, const at::Tensor& lora_B,
    const at::Tensor& xa, double scaling, const std::optional<at::Tensor>& x_lora, bool compute_grad_x,
    AddBase add_base) {
  auto [dxa, db] = low_rank_grads(grad_y, lora_B, xa, scaling);
  at::Tensor da = lora_a_grad(dxa, x_lora.value_or(x));
  const at::Tensor a = to_float(lora_A).contiguous();  // [r, K]
  const bool base_product = grad_y.size(0) > 0 && grad_y.size(1) > 0;
  at::Tensor grad_x = at::empty({0}, x.options());
  at::Tensor grad_x_lora = at::empty({0}, x.options());
  if (x_lora.has_value()) {
    grad_x_lora = at::empty(x.sizes(), x.options());
    write_low_rank(grad_x_lora, dxa, a, std::nullopt);
    if (compute_grad_x) {
      grad_x = base_product ? at::empty(x.sizes(), x.options()) : at::zeros(x.sizes(), x.options());
      if (base_product) add_base(grad_x, /*accumulate=*/false);
    }
  } else if (compute_grad_x) {
    grad_x = at::empty(x.sizes(), x.options());
    write_low_rank(grad_x, dxa, a, std::nullopt);
    if (base_product) add_base(grad_x, /*accumulate=*/true);
  }
  return {grad_x, grad_x_lora, da.to(lora_A.scalar_type()), db.to(lora_B.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
    const at::Tensor& lora_B, const at::Tensor& xa, double scaling, const std::optional<at::Tensor>& x_lora,
    bool compute_grad_x) {
  check_dense_weight(weight, x);
  const Shapes s = check_lora_inputs(x, weight.size(0), lora_A, lora_B, std::nullopt, x_lora);
  check_backward(grad_y, xa, s);
  return lora_backward(grad_y, x, lora_A, lora_B, xa, scaling, x_lora, compute_grad_x,
                       [&](at::Tensor& grad_x, bool accumulate) { dense_matmul(grad_x, grad_y, weight, accumulate); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_nf4_backward_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax,
    int64_t blocksize, const at::Tensor& lora_A, const at::Tensor& lora_B, const at::Tensor& xa, double scaling,
    const std::optional<at::Tensor>& x_lora, bool compute_grad_x, const std::optional<at::Tensor>& nested_absmax,
    const std::optional<at::Tensor>& nested_code, const std::optional<at::Tensor>& nested_offset,
    int64_t nested_blocksize) {
  const Shapes s = check_lora_inputs(x, lora_B.dim() == 2 ? lora_B.size(0) : -1, lora_A, lora_B, std::nullopt, x_lora);
  check_backward(grad_y, xa, s);
  return lora_backward(grad_y, x, lora_A, lora_B, xa, scaling, x_lora, compute_grad_x,
                       [&](at::Tensor& grad_x, bool accumulate) {
                         const nf4::DequantizeParams weight =
                             nf4_weight_params(packed, absmax, blocksize, s.n, s.k, nested_absmax, nested_code,
                                               nested_offset, nested_blocksize, x);
                         nf4_matmul_nn(grad_y, weight, s.n, grad_x, accumulate);
                       });
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("lora_linear", &lora_linear_cpu);
  m.impl("lora_linear_nf4", &lora_linear_nf4_cpu);
  m.impl("lora_linear_backward", &lora_linear_backward_cpu);
  m.impl("lora_linear_nf4_backward", &lora_linear_nf4_backward_cpu);
}

}  // namespace pykernels::lora
