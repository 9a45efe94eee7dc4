// Argument-check helpers every family's *_torch_checks.h uses (CPU and CUDA bindings alike):
// shapes written as Python prints them and the floating dtypes the kernels take. Messages name the
// argument and say what was expected (TORCH_CHECK_VALUE: raised as Python ValueError).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "common/dtype.h"

namespace pykernels {

// "(2, 3)", "(5,)": a shape as Python prints it.
inline std::string shape_string(at::IntArrayRef sizes) {
  std::string s = "(";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + (sizes.size() == 1 ? ",)" : ")");
}

// The kernels' DType of a float32, float16 or bfloat16 tensor; anything else names `name`.
inline DType float_dtype(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, name, " must be float32, float16 or bfloat16, got ", type);
  }
  return DType::kFloat32;  // unreachable
}

}  // namespace pykernels
