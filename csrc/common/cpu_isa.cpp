#include "common/cpu_isa.h"

#include <atomic>
#include <stdexcept>

#include "common/cpu_gemm_amx.h"

namespace pykernels {
namespace {

bool cpu_has_avx512() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // The AVX-512 kernels use F (floats), BW (16-bit lanes), VL (256-bit forms) and DQ.
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // FMA for the exp polynomial, F16C for fp16 outputs.
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<int> forced_isa{-1};  // -1: auto

}  // namespace

CpuIsa detected_cpu_isa() {
  static const CpuIsa detected = !cpu_has_avx512()   ? (cpu_has_avx2() ? CpuIsa::kAvx2 : CpuIsa::kScalar)
                                 : gemm::amx_usable() ? CpuIsa::kAmx
                                                      : CpuIsa::kAvx512;
  return detected;
}

CpuIsa active_cpu_isa() {
  const int forced = forced_isa.load(std::memory_order_relaxed);
  return forced < 0 ? detected_cpu_isa() : static_cast<CpuIsa>(forced);
}

void force_cpu_isa(const std::string& name) {
  if (name == "auto") {
    forced_isa.store(-1);
  } else if (name == "scalar") {
    forced_isa.store(static_cast<int>(CpuIsa::kScalar));
  } else if (name == "avx2") {
    if (detected_cpu_isa() == CpuIsa::kScalar) {  // every AVX-512 CPU has AVX2, FMA and F16C
      throw std::invalid_argument("cpu isa 'avx2' requested but this CPU lacks AVX2 / FMA / F16C");
    }
    forced_isa.store(static_cast<int>(CpuIsa::kAvx2));
  } else if (name == "avx512") {
    if (!uses_avx512(detected_cpu_isa())) {
      throw std::invalid_argument("cpu isa 'avx512' requested but this CPU lacks AVX-512 F/BW/VL/DQ");
    }
    forced_isa.store(static_cast<int>(CpuIsa::kAvx512));
  } else if (name == "amx") {
    if (detected_cpu_isa() != CpuIsa::kAmx) {
      throw std::invalid_argument(
          "cpu isa 'amx' requested but this CPU lacks AMX-TILE / AMX-BF16 / AVX-512 BF16, or Linux refused "
          "this process the tile state");
    }
    forced_isa.store(static_cast<int>(CpuIsa::kAmx));
  } else {
    throw std::invalid_argument("cpu isa must be 'auto', 'scalar', 'avx2', 'avx512' or 'amx', got '" + name + "'");
  }
}

std::string cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAmx: return "amx";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kScalar: break;
  }
  return "scalar";
}

}  // namespace pykernels
