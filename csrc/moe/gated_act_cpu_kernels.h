// The vector paths of the gated activation on the CPU (the math: moe/gated_act.h) for the case
// most MoE models train with: silu (SwiGLU: Qwen-MoE, Mixtral, DeepSeek), bf16, gate and up as the
// first and last `inner` columns. 16 (AVX-512) or 8 (AVX2) columns at a time in fp32, exp by Cephes'
// polynomial (~1 ulp), one rounding per output; gated_act_cpu.cpp calls them per range of rows where
// has_silu_gated_bf16() and takes the scalar formulas everywhere else. Torch-free.
#pragma once

#include <cstdint>

namespace pykernels::moe::cpu {

// Whether the active cpu isa (cpu_isa.h) has these kernels: AVX2 or AVX-512.
bool has_silu_gated_bf16();

// out[r, j] = silu(gate_up[r, j]) gate_up[r, inner + j] for r in [row_begin, row_end).
void silu_gated_bf16(const uint16_t* gate_up, int64_t row_begin, int64_t row_end, int64_t inner, uint16_t* out);

// grad_gate_up[r, j] and [r, inner + j] from grad_inner[r, j], for r in [row_begin, row_end).
void silu_gated_backward_bf16(const uint16_t* gate_up, const uint16_t* grad_inner, int64_t row_begin,
                              int64_t row_end, int64_t inner, uint16_t* grad_gate_up);

}  // namespace pykernels::moe::cpu
