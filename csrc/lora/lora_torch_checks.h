// Argument checks shared by the CPU and CUDA bindings of the fused LoRA ops. Messages name the
// tensor and say what was expected (raised as Python ValueError).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "nf4/nf4_torch_checks.h"

namespace pykernels::lora {

struct Shapes {
  int64_t m, k, n, r;
};

inline void check_matrix(const at::Tensor& t, const char* name, int64_t rows, int64_t cols, const char* meaning,
                         const at::Tensor& x) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, name, " must have shape ", meaning, " = ",
                    shape_string({rows, cols}), ", got ", shape_string(t.sizes()));
  TORCH_CHECK_VALUE(t.device() == x.device(), name, " must be on ", x.device(), " like x, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
}

// x [M, K], lora_A [r, K], lora_B [N, r] (A and B share a dtype: x's or float32), bias [N] in x's
// dtype, x_lora like x. Returns the sizes.
inline Shapes check_lora_inputs(const at::Tensor& x, int64_t out_features, const at::Tensor& lora_A,
                                const at::Tensor& lora_B, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& x_lora) {
  float_dtype(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D [tokens, in_features] (pykernels.lora flattens), got ",
                    shape_string(x.sizes()));
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous");
  const Shapes s{x.size(0), x.size(1), out_features, lora_A.dim() == 2 ? lora_A.size(0) : -1};
  TORCH_CHECK_VALUE(s.r >= 1, "lora_A must have shape (r, in_features) with r >= 1, got ",
                    shape_string(lora_A.sizes()));
  float_dtype(lora_A.scalar_type(), "lora_A");
  check_matrix(lora_A, "lora_A", s.r, s.k, "(r, in_features)", x);
  check_matrix(lora_B, "lora_B", s.n, s.r, "(out_features, r)", x);
  TORCH_CHECK_VALUE(lora_B.scalar_type() == lora_A.scalar_type(), "lora_B must have lora_A's dtype ",
                    lora_A.scalar_type(), ", got ", lora_B.scalar_type());
  TORCH_CHECK_VALUE(lora_A.scalar_type() == x.scalar_type() || lora_A.scalar_type() == at::kFloat,
                    "lora_A and lora_B must be float32 or x's dtype ", x.scalar_type(), ", got ",
                    lora_A.scalar_type());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == s.n, "bias must have shape (out_features,) = (", s.n,
                      ",), got ", shape_string(bias->sizes()));
    TORCH_CHECK_VALUE(bias->scalar_type() == x.scalar_type(), "bias must have x's dtype ", x.scalar_type(), ", got ",
                      bias->scalar_type());
    TORCH_CHECK_VALUE(bias->device() == x.device() && bias->is_contiguous(), "bias must be contiguous on ", x.device());
  }
  if (x_lora.has_value()) {
    TORCH_CHECK_VALUE(x_lora->sizes() == x.sizes() && x_lora->scalar_type() == x.scalar_type(),
                      "x_lora must have x's shape and dtype ", shape_string(x.sizes()), " ", x.scalar_type(),
                      ", got ", shape_string(x_lora->sizes()), " ", x_lora->scalar_type());
    TORCH_CHECK_VALUE(x_lora->device() == x.device() && x_lora->is_contiguous(), "x_lora must be contiguous on ",
                      x.device());
  }
  return s;
}

inline void check_dense_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be 2-D (out_features, in_features), got ",
                    shape_string(weight.sizes()));
  check_matrix(weight, "weight", weight.size(0), x.size(1), "(out_features, in_features)", x);
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight must have x's dtype ", x.scalar_type(), ", got ",
                    weight.scalar_type());
}

inline void check_backward(const at::Tensor& grad_y, const at::Tensor& xa, const Shapes& s) {
  TORCH_CHECK_VALUE(grad_y.dim() == 2 && grad_y.size(0) == s.m && grad_y.size(1) == s.n,
                    "grad_y must have shape (tokens, out_features) = ", shape_string({s.m, s.n}), ", got ",
                    shape_string(grad_y.sizes()));
  TORCH_CHECK_VALUE(grad_y.is_contiguous(), "grad_y must be contiguous");
  TORCH_CHECK_VALUE(xa.dim() == 2 && xa.size(0) == s.m && xa.size(1) == s.r && xa.scalar_type() == at::kFloat,
                    "xa must be float32 with shape (tokens, r) = ", shape_string({s.m, s.r}), ", got ",
                    xa.scalar_type(), " ", shape_string(xa.sizes()));
  TORCH_CHECK_VALUE(xa.is_contiguous(), "xa must be contiguous");
}

// The dequantize params of an NF4 weight [out_features, in_features] given to the LoRA ops.
inline nf4::DequantizeParams nf4_weight_params(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                                               int64_t out_features, int64_t in_features,
                                               const std::optional<at::Tensor>& nested_absmax,
                                               const std::optional<at::Tensor>& nested_code,
                                               const std::optional<at::Tensor>& nested_offset,
                                               int64_t nested_blocksize, const at::Tensor& x) {
  TORCH_CHECK_VALUE(out_features >= 1, "out_features must be >= 1, got ", out_features);
  TORCH_CHECK_VALUE(packed.device() == x.device(), "packed must be on ", x.device(), " like x, got ", packed.device());
  at::Tensor placeholder = at::empty({0}, x.options());  // the output pointer is set per chunk by the caller
  nf4::DequantizeParams p = nf4::dequantize_params(packed, absmax, blocksize, out_features * in_features,
                                                   nested_absmax, nested_code, nested_offset, nested_blocksize,
                                                   placeholder);
  p.out = nullptr;
  return p;
}

}  // namespace pykernels::lora
