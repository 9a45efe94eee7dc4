// Memory helpers for CPU kernels.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace pykernels {

// Asks the kernel to back the 2 MiB-aligned interior of [data, data + bytes) with transparent huge
// pages. Call it on a freshly allocated output before the first write: on a new buffer the
// first-touch faults (one per 4 KiB page) cost ~20x the work of a memory-bound kernel, and with
// huge pages a 32 MiB dequantize runs ~5x faster. A hint only: no effect off Linux, on small
// buffers, or where THP is disabled.
void advise_huge_pages(void* data, size_t bytes);

// Allocator of cache-line (64-byte) aligned storage. A std::vector's buffer from malloc is only
// 16-byte aligned (large ones sit 16 bytes into an mmap), so every 64-byte vector load or store
// of a GEMM operand would straddle two cache lines: ~20% of a bf16 micro-kernel's throughput.
template <class T>
struct CacheAlignedAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheAlignedAllocator() = default;
  template <class U>
  CacheAlignedAllocator(const CacheAlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlignment)); }
  void deallocate(T* p, size_t n) { ::operator delete(p, n * sizeof(T), kAlignment); }
  template <class U>
  bool operator==(const CacheAlignedAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheAlignedAllocator<U>&) const { return false; }
};

template <class T>
using AlignedVector = std::vector<T, CacheAlignedAllocator<T>>;

}  // namespace pykernels
