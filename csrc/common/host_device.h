// Marks the index/tile arithmetic shared by the CUDA kernels and the host: PYKERNELS_HOST_DEVICE is
// __host__ __device__ under nvcc and nothing under the host compiler, so one inline definition
// serves the .cu kernels, the CPU build and the host unit tests (pykernels._C.host_logic,
// tests/test_device_logic_host.py). Headers built on it include no CUDA header.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PYKERNELS_HOST_DEVICE __host__ __device__
#else
#define PYKERNELS_HOST_DEVICE
#endif

namespace pykernels {

PYKERNELS_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

PYKERNELS_HOST_DEVICE inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// One IEEE fp32 rounding per operation, whatever the compiler's contraction setting: the _rn
// intrinsics on the device; on the host plain operators (the CPU build uses -ffp-contract=off).
PYKERNELS_HOST_DEVICE inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PYKERNELS_HOST_DEVICE inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

}  // namespace pykernels
