// The CUDA bindings' knobs (PYKERNELS_SM90_TILE, PYKERNELS_MOE_RANK_TILE, PYKERNELS_NF4_CHUNK_MIB, ...):
// read on every call (a getenv, nanoseconds beside a kernel), so one process can time or check every
// choice (benchmarks/tile_sweep.py). Each knob's parser is torch-free and host-tested through
// pykernels._C.host_logic; here a setting it refuses becomes a ValueError carrying its message, which
// names the choices.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>

namespace pykernels {

// The value `parse(setting, &value)` gives for environment variable `variable` (`setting` null when
// unset); `parse` returns null, or the error. Every parser sets the value on success, unset included.
template <class T, class Parse>
T env_knob(const char* variable, Parse&& parse) {
  T value{};
  const char* error = parse(std::getenv(variable), &value);
  TORCH_CHECK_VALUE(error == nullptr, error);
  return value;
}

}  // namespace pykernels
