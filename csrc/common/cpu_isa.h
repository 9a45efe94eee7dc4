// Which SIMD code path the CPU kernels take. Kernels are compiled for several instruction sets
// (function target attributes) and pick one at run time, so one binary runs on any x86-64 and
// uses AVX2 or AVX-512 where the CPU has it. Tests force each path the CPU can run.
#pragma once

#include <string>

namespace pykernels {

// Each path includes the one before it: kAvx2 is AVX2 with FMA and F16C (AMD Zen 1-3, Intel
// Haswell to the client cores of today); kAmx is kAvx512 whose bf16 GEMMs (cpu_gemm_bf16.h) run on
// the AMX tiles.
enum class CpuIsa { kScalar, kAvx2, kAvx512, kAmx };

// Whether a kernel takes its AVX-512 code under `isa` (also the AMX path's: only its GEMMs differ).
inline bool uses_avx512(CpuIsa isa) { return isa == CpuIsa::kAvx512 || isa == CpuIsa::kAmx; }

// Whether a kernel that has AVX2 code takes it: on the AVX2 path only (the AVX-512 paths take their
// own). Only the bandwidth-bound kernels have it (NF4 dequantize, the gated activation); the rest
// run their portable code there.
inline bool uses_avx2(CpuIsa isa) { return isa == CpuIsa::kAvx2; }

// The path in use: the best the CPU supports, unless force_cpu_isa() chose another.
CpuIsa active_cpu_isa();

// Best path this CPU supports.
CpuIsa detected_cpu_isa();

// Force a path by name ("scalar", "avx2", "avx512", "amx") or "auto". Throws std::invalid_argument for an
// unknown name or a path the CPU cannot run.
void force_cpu_isa(const std::string& name);

std::string cpu_isa_name(CpuIsa isa);

}  // namespace pykernels
