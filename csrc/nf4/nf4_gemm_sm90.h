// The Hopper QLoRA GEMM (nf4/nf4_gemm_sm90.cu): y = x W^T + beta y with W in bitsandbytes' NF4,
// decoded in the GEMM's mainloop, so no dequantized copy of W is written to or read from HBM (the
// weight streams at half a byte per element). CUTLASS 3.x's mixed-input mainloop (TMA loads, a
// warp-specialized persistent wgmma pipeline; example 55) with the codes as its narrow operand:
// each consumer thread loads its codes from shared memory into registers, decodes them to bf16
// (nf4/nf4_decode_bf16.h), multiplies by the block's scale and issues wgmma from registers.
//
//   x       bf16 [m, k], row stride k
//   packed  W's codes, [n, k] row-major in bitsandbytes' packing (nf4_layout.h)
//   scales  fp32 [k / blocksize, n]: scales[g][i] = absmax of W[i, g * blocksize ...]
//           (bitsandbytes' absmax transposed, decoded first when double-quantized: the
//           mainloop's scale operand is M-major)
//   y       bf16 [m, n], row stride n; read first when beta != 0
//
// Numerics: each weight is bf16(bf16(code value) * absmax) with an fp32 product, where
// bitsandbytes rounds the fp32 code value's product once: within 1 bf16 ulp of its dequantized
// weight (host-tested over every code, tests/kernels/lora/test_nf4_gemm_host.py); fp32
// accumulation as cuBLAS. Exact fp32 code values would take twice the byte permutes.
// Blocks must not straddle rows and must cover whole k tiles of the mainloop (64): blocksize a
// multiple of 64 dividing k. Built only when the archs include sm_90a.
#pragma once

#include <cstdint>

#include "common/tails.h"
#include "common/two_way_choice.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::nf4 {

inline constexpr int64_t kNf4GemmTileK = 64;  // the mainloop's k tile: 128 bytes of bf16

struct Nf4GemmSm90Params {
  int64_t m, n, k;
  const void* x;
  const uint8_t* packed;
  const void* scales;
  int64_t blocksize;
  void* y;
  float beta;
};

// What the kernel and TMA need of p, or null (checked by the launcher; host-tested through
// pykernels._C.host_logic).
inline const char* nf4_gemm_sm90_error(const Nf4GemmSm90Params& p) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (p.m < 1 || p.n < 1 || p.k < 1 || p.m >= kMax || p.n >= kMax || p.k >= kMax)
    return "NF4 GEMM sizes must lie in [1, 2^31)";
  if (p.blocksize < kNf4GemmTileK || p.blocksize % kNf4GemmTileK != 0 || p.k % p.blocksize != 0)
    return "the NF4 GEMM needs a blocksize that is a multiple of 64 and divides in_features";
  if (p.n % 8 != 0) return "the NF4 GEMM needs out_features a multiple of 8 (16-byte rows of y and the scales)";
  if (!is_aligned(p.x, 16) || !is_aligned(p.packed, 16) || !is_aligned(p.scales, 16) || !is_aligned(p.y, 16))
    return "the NF4 GEMM needs 16-byte aligned x, packed weight, scales and y";
  return nullptr;
}

// PYKERNELS_SM90_NF4 picks how the QLoRA forward reads its NF4 weight on Hopper (`setting`; null
// or empty: the default): dequantize (chunks of W dequantized to bf16 for cuBLAS, the measured path)
// or mainloop (this GEMM). Sets *mainloop; returns null, or an error naming the choices.
inline const char* nf4_sm90_forward_for(const char* setting, bool* mainloop) {
  return two_way_choice(setting, "dequantize", "mainloop",
                        "PYKERNELS_SM90_NF4 must be dequantize (the default) or mainloop", mainloop);
}

// True when this build has the kernel (the archs include sm_90a).
bool nf4_gemm_sm90_built();

// Runs the GEMM on the device's current stream `stream`; null on success, else what failed.
// `workspace` holds nf4_gemm_sm90_workspace_bytes(p) bytes (none when that is 0).
int64_t nf4_gemm_sm90_workspace_bytes(const Nf4GemmSm90Params& p, int device);
const char* run_nf4_gemm_sm90(const Nf4GemmSm90Params& p, void* workspace, int device, cudaStream_t stream);

}  // namespace pykernels::nf4
