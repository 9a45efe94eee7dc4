// Memory helpers for CPU kernels.
#pragma once

#include <cstddef>

namespace pykernels {

// Asks the kernel to back the 2 MiB-aligned interior of [data, data + bytes) with transparent huge
// pages. Call it on a freshly allocated output before the first write: on a new buffer the
// first-touch faults (one per 4 KiB page) cost ~20x the work of a memory-bound kernel, and with
// huge pages a 32 MiB dequantize runs ~5x faster. A hint only: no effect off Linux, on small
// buffers, or where THP is disabled.
void advise_huge_pages(void* data, size_t bytes);

}  // namespace pykernels
