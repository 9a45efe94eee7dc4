// CUDA element types of the kernel families (float / __half / __nv_bfloat16): the run-time dtype
// dispatch and fp32 <-> element conversions (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/dtype.h"

namespace pykernels {

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float(float v) { return v; }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float(float v) { return v; }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }

// Calls fn(T{}) with T the CUDA element type of dtype; fn returns an error message or nullptr.
template <typename Fn>
const char* with_element(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(__half{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
  }
  return "unknown dtype";
}

}  // namespace pykernels
