// The AMX part of the CPU bf16 GEMM (cpu_gemm_bf16.h): Intel's tile unit (Sapphire Rapids on) runs
// a 16x16x32 bf16 product per instruction (tdpbf16ps), ~8x the FLOPs per cycle of vdpbf16ps, and
// reads B in exactly the pair-packed panels the AVX-512 micro-kernel already reads. Torch-free.
#pragma once

#include <cstdint>

namespace pykernels::gemm {

// Whether this CPU has AMX-TILE and AMX-BF16 and Linux granted this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once here: without it the first tile instruction is a SIGILL).
bool amx_usable();

// Pairs of K the tiles take: whole steps of 32 elements. gemm_bf16 runs the rest of K (fewer than
// 32) on AVX-512.
inline int64_t amx_pairs(int64_t k) { return k / 32 * 16; }

// A's part the tiles read (its first 2 * amx_pairs(k) columns), copied into the order they read it:
// amx_packed_a_size uint16 elements. gemm_bf16_amx does this itself on every call unless given it.
inline int64_t amx_packed_a_size(int64_t m, int64_t k) { return 2 * amx_pairs(k) * ((m + 15) / 16 * 16); }
void amx_pack_a(const uint16_t* a, int64_t lda, int64_t m, int64_t k, uint16_t* dst);

// C[M, N] (+)= A[M, 2 * amx_pairs(k)] B[2 * amx_pairs(k), N] (operands as gemm_bf16's: every row and
// column, partial tiles included, C untouched past them); accumulate = false overwrites. a_packed:
// amx_pack_a(a, lda, m, k), or null to pack A here. Needs amx_usable() and amx_pairs(k) > 0.
void gemm_bf16_amx(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* a_packed,
                   const uint32_t* b, int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate);

}  // namespace pykernels::gemm
