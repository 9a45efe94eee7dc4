// The LoRA forward on Hopper as one GEMM (lora_forward_sm90.cu): the base product with the LoRA
// term and bias as extra K (lora_extended_k.h builds U and V),
//
//   y [m, n] = x W^T + U V^T      x [m, k], W [n, k], U [m, extra_k], V [n, extra_k], all bf16
//
// on CUTLASS 3.x's warp-specialized cooperative kernel (TMA loads, wgmma, fp32 accumulators) with
// common/extended_k_mainloop_sm90.cuh's mainloop: 128x256x64 tiles on a 2x1 cluster (each W tile
// loaded once by TMA multicast for two CTAs of tokens), the shape of cuBLAS's and CUTLASS's fastest
// large bf16 GEMMs on Hopper. y is written by TMA store, once: against cuBLAS's x W^T plus the LoRA
// term as its C operand (what lora_cuda_torch.cpp runs otherwise), no [m, n] pass is added for the
// term. Torch-free; built only when the archs include sm_90a (cmake/sm90_sources.cmake), run where
// the GEMM core runs (grouped_gemm_sm90_available).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/tails.h"
#include "lora/lora_extended_k.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::lora {

// PYKERNELS_SM90_LORA picks how the forward runs on Hopper (`setting`; null or empty: the default):
//   cublas      x W^T on cuBLAS (through ATen) with the LoRA term and bias, written by a small
//               kernel first, as its C operand (beta 1): the default, what an H100 has measured
//   extended_k  this file's one GEMM: no pass over y for the term, K grows by extra_k
// Null on success, else a message naming the choices. Read on every call (benchmarks/tile_sweep.py
// times both in one process).
inline const char* lora_sm90_forward_for(const char* setting, bool* extended_k) {
  *extended_k = false;
  if (setting == nullptr || setting[0] == '\0' || std::strcmp(setting, "cublas") == 0) return nullptr;
  if (std::strcmp(setting, "extended_k") == 0) {
    *extended_k = true;
    return nullptr;
  }
  return "PYKERNELS_SM90_LORA must be cublas (the default) or extended_k";
}

struct LoraForwardSm90Params {
  int64_t m, n, k;
  const void* x;  // [m, k], row stride ldx
  int64_t ldx;
  const void* w;  // [n, k], row stride ldw
  int64_t ldw;
  const void* u;  // [m, extra_k], contiguous
  const void* v;  // [n, extra_k], contiguous
  int64_t extra_k;
  void* y;        // [m, n], row stride ldy
  int64_t ldy;
};

// What TMA, the 32-bit CUTLASS shapes and the extended mainloop need of p, or null (checked by the
// launcher; host-tested through pykernels._C.host_logic).
inline const char* lora_forward_sm90_error(const LoraForwardSm90Params& p) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.m >= kMax || p.n >= kMax) return "GEMM sizes must lie in [1, 2^31)";
  if (p.extra_k < kExtendedKTile || p.extra_k % kExtendedKTile != 0) return "extra_k must be a positive multiple of 64";
  if (ceil_div(p.k, kExtendedKTile) * kExtendedKTile + p.extra_k >= kMax) return "k + extra_k must be below 2^31";
  if (p.k % 8 != 0 || p.n % 8 != 0) return "k and n must be multiples of 8 (16-byte rows for TMA)";
  if (p.ldx < p.k || p.ldx % 8 != 0 || p.ldw < p.k || p.ldw % 8 != 0 || p.ldy < p.n || p.ldy % 8 != 0)
    return "every row stride must be a multiple of 16 bytes, at least its row";
  if (!is_aligned(p.x, 16) || !is_aligned(p.w, 16) || !is_aligned(p.u, 16) || !is_aligned(p.v, 16) ||
      !is_aligned(p.y, 16) || p.x == nullptr || p.w == nullptr || p.u == nullptr || p.v == nullptr ||
      p.y == nullptr)
    return "x, w, u, v and y must be 16-byte aligned";
  return nullptr;
}

bool lora_forward_sm90_built();  // compiled for sm_90a into this build
int64_t lora_forward_sm90_workspace_bytes(const LoraForwardSm90Params& p, int device);
// nullptr on success, else a message.
const char* launch_lora_forward_sm90(const LoraForwardSm90Params& p, void* workspace, int device, cudaStream_t stream);

}  // namespace pykernels::lora
