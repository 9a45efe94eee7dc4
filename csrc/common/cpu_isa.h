// Which SIMD code path the CPU kernels take. Kernels are compiled for several instruction sets
// (function target attributes) and pick one at run time, so one binary runs on any x86-64 and
// uses AVX-512 where the CPU has it. Tests force the portable path to cover both.
#pragma once

#include <string>

namespace pykernels {

enum class CpuIsa { kScalar, kAvx512 };

// The path in use: the best the CPU supports, unless force_cpu_isa() chose another.
CpuIsa active_cpu_isa();

// Best path this CPU supports.
CpuIsa detected_cpu_isa();

// Force a path by name ("scalar", "avx512") or "auto". Throws std::invalid_argument for an
// unknown name or a path the CPU cannot run.
void force_cpu_isa(const std::string& name);

std::string cpu_isa_name(CpuIsa isa);

}  // namespace pykernels
