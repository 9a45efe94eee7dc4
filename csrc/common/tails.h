// Tail and alignment predicates of vectorized accesses: which elements a `width`-wide load or store
// at element `first` may touch, and when a 16-byte (or wider) access is legal. A vector access is
// taken only when all of its elements exist and its address is aligned; everything else falls back
// to element-wise accesses guarded by elements_in_range.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels {

// How many of the elements [first, first + width) lie below numel (first >= 0): 0 past the end,
// width for a whole vector, numel - first in the tail.
PYKERNELS_HOST_DEVICE inline int64_t elements_in_range(int64_t first, int64_t width, int64_t numel) {
  const int64_t left = numel - first;
  return left < 0 ? 0 : (left < width ? left : width);
}

// All of [first, first + width) lie below numel.
PYKERNELS_HOST_DEVICE inline bool whole_vector_in_range(int64_t first, int64_t width, int64_t numel) {
  return first + width <= numel;
}

PYKERNELS_HOST_DEVICE inline bool is_aligned(const void* address, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(address) % bytes == 0;
}

// Every access of `elements` consecutive elements (element_bytes each) at columns 0, elements,
// 2 elements, ... of every row of a matrix (row r starts at base + r * ld elements, rows hold
// contiguous_extent elements) is aligned to its own size and stays inside its row: the base, the
// leading dimension and the contiguous extent are all multiples of the access.
PYKERNELS_HOST_DEVICE inline bool rows_vector_aligned(const void* base, int64_t ld, int64_t contiguous_extent,
                                                      int elements, int element_bytes) {
  return is_aligned(base, uintptr_t(elements) * element_bytes) && ld % elements == 0 &&
         contiguous_extent % elements == 0;
}

}  // namespace pykernels
