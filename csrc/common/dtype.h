// Element types the kernels handle, shared by every family (torch-free: included by .cu files).
#pragma once

namespace pykernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline constexpr int dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace pykernels
