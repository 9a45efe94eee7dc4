// The two-way knobs (PYKERNELS_SM90_LORA, PYKERNELS_SM90_NF4, PYKERNELS_SM90_MOE_LORA, PYKERNELS_NF4_DEQUANT, ...),
// read on every call so one process can time both ways (benchmarks/tile_sweep.py). Torch- and
// CUDA-free: host-tested through pykernels._C.host_logic with each knob.
#pragma once

#include <cstring>

namespace pykernels {

// `setting` (null or empty: the default, `first`) must name `first` or `second`: sets *second_chosen
// and returns null, else returns `error` (the message naming both).
inline const char* two_way_choice(const char* setting, const char* first, const char* second, const char* error,
                                  bool* second_chosen) {
  *second_chosen = false;
  if (setting == nullptr || setting[0] == '\0' || std::strcmp(setting, first) == 0) return nullptr;
  if (std::strcmp(setting, second) == 0) {
    *second_chosen = true;
    return nullptr;
  }
  return error;
}

}  // namespace pykernels
