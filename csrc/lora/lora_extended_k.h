// LoRA as extra K of the base GEMM (the Hopper forward by default, PYKERNELS_SM90_LORA):
//
//   y = x W^T + bias + scaling (x_lora A^T) B^T  =  [x | U] [W | V]^T
//
// and the backward's input gradient alike under PYKERNELS_SM90_LORA_GRAD_X=extended_k (dense W, no
// x_lora): grad_x = dy W + dxa A = [dy | U] [W ; V^T] with U from dxa (scaling 1) and V from A^T,
// by the same packing.
//
// with U [m, width] and V [n, width] two small bf16 operands built from xa = x_lora A^T (fp32),
// B and the bias, run as one group of the Hopper GEMM core with extra K (common/grouped_gemm_sm90.h,
// common/extended_k_array_mainloop_sm90.cuh: k tiles from (x, W), then from (U, V)). The base
// GEMM's K grows by `width` (64 at r <= 21: 1.6% of K = 4096) and the LoRA term and bias cost no
// pass over y: the 5% budget of issue 20 over the bare base GEMM.
//
// Precision: wgmma multiplies bf16, but PEFT's fp32 adapters keep the LoRA path in fp32. Each
// fp32 factor is split into two bf16 parts, f = hi + lo (hi = bf16(f), lo = bf16(f - hi)), and
//   u B^T ~ u_hi B_hi^T + u_lo B_hi^T + u_hi B_lo^T
// (the dropped u_lo B_lo^T is ~2^-16 of the term; each bf16 product is exact in the fp32
// accumulator). A bf16 B has no lo part: two terms. The bias (x's dtype) is one more column, 1 in U
// against bias in V, exact. Columns past those are zeros up to a multiple of the K tile.
//
//   U[i, t r + j] = (t == 1 ? lo : hi)(scaling xa[i, j])   t = 0, 1, 2 (term)
//   V[o, t r + j] = (t == 2 ? lo : hi)(B[o, j])
//   U[i, terms r] = 1, V[o, terms r] = bias[o]              with a bias
//
// Torch- and CUDA-free: the packing kernel (lora.cu) and the host tests (pykernels._C.host_logic)
// share these functions.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"
#include "common/two_way_choice.h"

namespace pykernels::lora {

// PYKERNELS_SM90_LORA picks how the forward runs on Hopper (`setting`; null or empty: the default):
//   extended_k  one GEMM on the Hopper core with the term and bias as extra K: no pass over y for the
//               term, K grows by the width below. The default: 1.08-1.19x faster than cublas on an
//               H100 at r 16, T 8192 on 4096 x 14336 and 1.02-1.09x on 4096 x 4096 (bf16 and NF4
//               weights, fp32 and bf16 adapters; benchmarks/results/h100.md, 2026-11-27)
//   cublas      x W^T on cuBLAS (through ATen) with the LoRA term and bias, written by a small
//               kernel first, as its C operand (beta 1)
// Sets *cublas; null on success, else a message naming the choices. Read on every call
// (benchmarks/tile_sweep.py times both in one process).
inline const char* lora_sm90_forward_for(const char* setting, bool* cublas) {
  return two_way_choice(setting, "extended_k", "cublas",
                        "PYKERNELS_SM90_LORA must be extended_k (the default) or cublas", cublas);
}

// PYKERNELS_SM90_LORA_GRAD_X picks how the backward's input gradient runs on Hopper (dense W, no
// x_lora):
//   cublas      dy W on cuBLAS, dxa A added by the rank kernel: the default, 1.02x faster than the other
//               on an H100 (a step at 4096 x 14336, T 8192, r 16: 4.40 against 4.48 ms; benchmarks/
//               results/h100.md, 2026-11-27 second lease)
//   extended_k  grad_x = [dy | U] [W ; V^T], one GEMM on the Hopper core
inline const char* lora_sm90_grad_x_for(const char* setting, bool* extended_k) {
  return two_way_choice(setting, "cublas", "extended_k",
                        "PYKERNELS_SM90_LORA_GRAD_X must be cublas (the default) or extended_k", extended_k);
}

inline constexpr int64_t kExtendedKTile = 64;  // the Hopper GEMM's K tile: the width's multiple

struct ExtendedK {
  int64_t r;
  int64_t terms;  // 3 with an fp32 B (hi/lo of both factors), 2 with a 16-bit B
  bool bias;
  int64_t width;  // columns of U and V: terms r (+ 1), rounded up to kExtendedKTile
};

inline ExtendedK extended_k(int64_t r, bool b_is_fp32, bool has_bias) {
  const int64_t terms = b_is_fp32 ? 3 : 2;
  const int64_t used = terms * r + (has_bias ? 1 : 0);
  return {r, terms, has_bias, (used + kExtendedKTile - 1) / kExtendedKTile * kExtendedKTile};
}

// An fp32 bit pattern of an infinity or NaN (all exponent bits set).
PYKERNELS_HOST_DEVICE inline bool non_finite_bits(uint32_t bits) { return (bits & 0x7f800000u) == 0x7f800000u; }

// v rounded to the nearest bf16 (ties to even), as a float; NaN stays NaN, infinities stay.
PYKERNELS_HOST_DEVICE inline float bf16_rounded(float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  if (non_finite_bits(bits)) {
    bits = (bits & 0x007fffffu) != 0 ? (bits | 0x00400000u) & 0xffff0000u : bits;  // quiet NaN, or inf
  } else {
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  }
  memcpy(&v, &bits, sizeof v);
  return v;
}

// U[row, col] from the row's xa (r fp32 values). Every value is a bf16 (exactly representable).
PYKERNELS_HOST_DEVICE inline float extended_u(const ExtendedK& e, const float* xa_row, float scaling, int64_t col) {
  if (col < e.terms * e.r) {
    const float u = mul_rn(scaling, xa_row[col % e.r]);  // _rn: no FMA into u - hi on the device
    const float hi = bf16_rounded(u);
    return col / e.r == 1 ? bf16_rounded(u - hi) : hi;
  }
  return e.bias && col == e.terms * e.r ? 1.0f : 0.0f;
}

// V[row, col] from B[row, col % r] (b, as a float) and bias[row] (a bf16 value, or 0).
PYKERNELS_HOST_DEVICE inline float extended_v(const ExtendedK& e, float b, float bias, int64_t col) {
  if (col < e.terms * e.r) {
    const float hi = bf16_rounded(b);
    return col / e.r == 2 ? bf16_rounded(b - hi) : hi;
  }
  return e.bias && col == e.terms * e.r ? bias : 0.0f;
}

}  // namespace pykernels::lora
