// Argument checks and params construction shared by the CPU and CUDA bindings of the NF4 ops.
// Every message names the argument and says what was expected (raised as Python ValueError).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "common/torch_checks.h"
#include "nf4/nf4.h"

namespace pykernels::nf4 {

inline void check_blocksize(int64_t blocksize, const char* name) {
  const bool power_of_two = blocksize > 0 && (blocksize & (blocksize - 1)) == 0;
  TORCH_CHECK_VALUE(power_of_two && blocksize >= 32 && blocksize <= 4096, name,
                    " must be a power of two in [32, 4096], got ", blocksize);
}

inline void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                         int64_t numel, const at::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " like the other inputs, got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_VALUE(t.numel() == numel, name, " must have ", numel, " elements, got ", t.numel(),
                    " (shape ", shape_string(t.sizes()), ")");
}

inline void check_input(const at::Tensor& x, const char* name) {
  float_dtype(x.scalar_type(), name);
  TORCH_CHECK_VALUE(x.numel() > 0, name, " must not be empty, got shape ", shape_string(x.sizes()));
  TORCH_CHECK_VALUE(x.is_contiguous(), name, " must be contiguous (call .contiguous() first)");
}

// A caller's output tensor for nf4_dequantize_into (its numel is checked against packed's).
inline void check_out(const at::Tensor& out, const at::Tensor& packed) {
  float_dtype(out.scalar_type(), "out");
  TORCH_CHECK_VALUE(out.device() == packed.device(), "out must be on ", packed.device(), " like packed, got ",
                    out.device());
  TORCH_CHECK_VALUE(out.is_contiguous(), "out must be contiguous");
}

// Builds and checks the dequantize params; `out` must already have the output dtype and numel.
inline DequantizeParams dequantize_params(const at::Tensor& packed, const at::Tensor& absmax,
                                          int64_t blocksize, int64_t numel,
                                          const std::optional<at::Tensor>& nested_absmax,
                                          const std::optional<at::Tensor>& nested_code,
                                          const std::optional<at::Tensor>& nested_offset,
                                          int64_t nested_blocksize, const at::Tensor& out) {
  check_blocksize(blocksize, "blocksize");
  TORCH_CHECK_VALUE(numel > 0, "shape must have at least one element, got numel ", numel);
  const at::Device device = packed.device();
  const int64_t blocks = num_blocks(numel, blocksize);
  check_tensor(packed, "packed", at::kByte, (numel + 1) / 2, device);

  DequantizeParams p{};
  p.packed = packed.data_ptr<uint8_t>();
  p.numel = numel;
  p.blocksize = blocksize;
  p.out = out.data_ptr();
  p.out_dtype = float_dtype(out.scalar_type(), "dtype");

  const int given = nested_absmax.has_value() + nested_code.has_value() + nested_offset.has_value();
  TORCH_CHECK_VALUE(given == 0 || given == 3,
                    "nested_absmax, nested_code and nested_offset must be given together (double "
                    "quantization) or not at all, got ", given, " of them");
  if (given == 0) {
    check_tensor(absmax, "absmax", at::kFloat, blocks, device);
    p.scales.absmax = absmax.data_ptr<float>();
    return p;
  }
  TORCH_CHECK_VALUE(nested_blocksize > 0, "nested_blocksize must be positive, got ", nested_blocksize);
  check_tensor(absmax, "absmax (uint8 codes with double quantization)", at::kByte, blocks, device);
  check_tensor(*nested_absmax, "nested_absmax", at::kFloat, num_blocks(blocks, nested_blocksize), device);
  check_tensor(*nested_code, "nested_code", at::kFloat, 256, device);
  check_tensor(*nested_offset, "nested_offset", at::kFloat, 1, device);
  p.scales.absmax_q = absmax.data_ptr<uint8_t>();
  p.scales.nested_absmax = nested_absmax->data_ptr<float>();
  p.scales.nested_code = nested_code->data_ptr<float>();
  p.scales.nested_offset = nested_offset->data_ptr<float>();
  p.scales.nested_blocksize = nested_blocksize;
  return p;
}

// Checks the inputs and allocates `q` and `absmax`.
inline Dynamic8QuantizeParams dynamic8_quantize_params(const at::Tensor& x, const at::Tensor& code,
                                                       int64_t blocksize,
                                                       const std::optional<at::Tensor>& offset,
                                                       at::Tensor& q, at::Tensor& absmax) {
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.numel() > 0, "x must not be empty");
  TORCH_CHECK_VALUE(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK_VALUE(blocksize > 0, "blocksize must be positive, got ", blocksize);
  check_tensor(code, "code", at::kFloat, 256, x.device());
  if (offset.has_value()) check_tensor(*offset, "offset", at::kFloat, 1, x.device());
  q = at::empty({x.numel()}, x.options().dtype(at::kByte));
  absmax = at::empty({num_blocks(x.numel(), blocksize)}, x.options());
  return Dynamic8QuantizeParams{x.data_ptr<float>(), offset.has_value() ? offset->data_ptr<float>() : nullptr,
                                code.data_ptr<float>(), x.numel(), blocksize, q.data_ptr<uint8_t>(),
                                absmax.data_ptr<float>()};
}

// Checks the inputs and allocates `out` (fp32 [numel]).
inline Dynamic8DequantizeParams dynamic8_dequantize_params(const at::Tensor& q, const at::Tensor& absmax,
                                                           const at::Tensor& code, int64_t blocksize,
                                                           at::Tensor& out) {
  TORCH_CHECK_VALUE(q.scalar_type() == at::kByte, "q must be uint8, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK_VALUE(blocksize > 0, "blocksize must be positive, got ", blocksize);
  check_tensor(absmax, "absmax", at::kFloat, num_blocks(q.numel(), blocksize), q.device());
  check_tensor(code, "code", at::kFloat, 256, q.device());
  out = at::empty({q.numel()}, q.options().dtype(at::kFloat));
  return Dynamic8DequantizeParams{q.data_ptr<uint8_t>(), absmax.data_ptr<float>(), code.data_ptr<float>(),
                                  q.numel(), blocksize, out.data_ptr<float>()};
}

}  // namespace pykernels::nf4
