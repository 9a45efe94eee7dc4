// CPU kernels of the grouped MoE GEMM that are not the GEMM itself (common/cpu_gemm_bf16.h): the
// epilogue that turns an expert's transposed fp32 output tile into bf16 output rows, and the
// per-token sum of gated rows. AVX-512 BF16 only, like the bf16 GEMM path that calls them (other
// CPUs and dtypes take torch's GEMMs). Torch-free; moe_cpu_forward.cpp and moe_cpu_backward.cpp
// drive them.
#pragma once

#include <cstdint>

namespace pykernels::moe::cpu {

// dst[dst_rows[j] * ld_dst + o] = bf16(gate[j] * tile[o * ld + j]) for o < rows, j < cols (gates
// may be null: 1). The tile holds an expert's outputs [output features][slots] (the GEMM ran
// W_e x^T so that W_e's rows stream through as the A operand unpacked); dst_rows says where each
// slot's row goes (slot order, assignment order or a workspace).
void store_transposed_bf16(const float* tile, int64_t ld, int64_t rows, int64_t cols, const float* gates,
                           uint16_t* dst, const int64_t* dst_rows, int64_t ld_dst);

// out[t * n + c] = bf16(sum_j rows[slot_of[t * top_k + j] * n + c]) for t < tokens, summed in fp32
// in j order; slot_of < 0 (a dropped assignment) contributes nothing.
void sum_slots_bf16(const uint16_t* rows, const int64_t* slot_of, int64_t tokens, int64_t top_k, int64_t n,
                    uint16_t* out);

// The epilogue of a GEMM tile c [rows = slots][ldc] fp32, ungated (the backward's d(x) = dy W_e +
// LoRA; the forward's y for weights stored [E, in, out], without dgate and x):
// dgate[j] = dot(c[j], x row j) when dgate is given (x rows at x + x_offsets[j], cols each), and
// dst[dst_rows[j] * ld_dst + col] = bf16(gate[j] * c[j][col]) (gates may be null: 1).
void gate_rows_bf16(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* gates, const uint16_t* x,
                    const int64_t* x_offsets, float* dgate, uint16_t* dst, const int64_t* dst_rows, int64_t ld_dst);

}  // namespace pykernels::moe::cpu
