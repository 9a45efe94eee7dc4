// How many rows of an NF4 weight [n, k] the CUDA LoRA op dequantizes per GEMM (lora_cuda_torch.cpp,
// Nf4RowChunks): the QLoRA forward's y[:, rows] = x W[rows]^T and the backward's dy[:, rows] W[rows]
// run one chunk at a time through one reused buffer, so the dequantized copy of W never exceeds a
// chunk. Torch- and CUDA-free: host-tested through pykernels._C.host_logic.
//
// The default: 16 MiB of rows, grown until the forward's GEMM of one chunk has kNf4ChunkWaves waves of
// 128 x 256 tiles (the Hopper core's tile at these shapes) on the device's SMs, at most the whole
// weight (what bitsandbytes' dequantize allocates on every call). Fixed 16 MiB chunks of a 4096 x
// 14336 weight at T 1024 were 2048 rows, 8 x 8 tiles on an H100's 132 SMs (under half a wave), seven
// such GEMMs in a row: 0.479 ms against the bf16 forward's 0.250 (benchmarks/results/h100.md,
// 2026-11-27 second lease). PYKERNELS_NF4_CHUNK_MIB=N caps a chunk at N MiB instead (less memory,
// more and smaller GEMMs). Chunks are balanced (n split evenly) and multiples of 8 rows, so each
// chunk's columns of y stay 16-byte aligned.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace pykernels::lora {

inline constexpr int64_t kNf4ChunkBytes = int64_t{16} << 20;
inline constexpr int64_t kNf4ChunkWaves = 4;
inline constexpr int64_t kNf4ChunkTileM = 128, kNf4ChunkTileN = 256;

// PYKERNELS_NF4_CHUNK_MIB (`setting`; null, empty or `auto`: the default, *cap_bytes = 0): a whole
// number of MiB from 1 to 2^20. Null on success, else a message naming what is allowed.
inline const char* nf4_chunk_cap_for(const char* setting, int64_t* cap_bytes) {
  constexpr int64_t kMaxMib = int64_t{1} << 20;
  *cap_bytes = 0;
  if (setting == nullptr || setting[0] == '\0' || std::strcmp(setting, "auto") == 0) return nullptr;
  int64_t mib = 0;
  for (const char* c = setting; *c != '\0' && mib <= kMaxMib; ++c) {
    mib = *c >= '0' && *c <= '9' ? mib * 10 + (*c - '0') : -1;
    if (mib < 0) break;
  }
  if (mib < 1 || mib > kMaxMib) {
    return "PYKERNELS_NF4_CHUNK_MIB must be a whole number of MiB from 1 to 1048576, or auto (the default: chunks "
           "grown until their GEMM fills the GPU)";
  }
  *cap_bytes = mib << 20;
  return nullptr;
}

// Rows per chunk of W [n, k] for m tokens of element_size-byte x on a device of `sms`
// multiprocessors (0: unknown, no growth), under cap_bytes (0: the default rule above): a multiple of
// 8 of at least 8 rows, or n.
inline int64_t nf4_chunk_rows(int64_t n, int64_t k, int64_t m, int64_t element_size, int64_t sms,
                              int64_t cap_bytes) {
  if (n < 1 || k < 1 || element_size < 1) return n;  // nothing to split
  int64_t rows = (cap_bytes > 0 ? cap_bytes : kNf4ChunkBytes) / (k * element_size);
  if (cap_bytes == 0 && sms > 0 && m > 0) {  // the rows whose GEMM has kNf4ChunkWaves waves of tiles
    const int64_t filling = ceil_div(kNf4ChunkWaves * sms, ceil_div(m, kNf4ChunkTileM)) * kNf4ChunkTileN;
    rows = rows > filling ? rows : filling;
  }
  if (rows >= n) return n;
  rows = rows < 8 ? 8 : rows / 8 * 8;
  const int64_t even = ceil_div(ceil_div(n, ceil_div(n, rows)), 8) * 8;  // n split evenly, <= rows
  return even < n ? even : n;
}

}  // namespace pykernels::lora
