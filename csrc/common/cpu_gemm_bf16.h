// bf16 GEMM for the CPU kernels: an AVX-512 BF16 micro-kernel (vdpbf16ps: exact bf16 products,
// fp32 sums) over a packed B operand, and the packings it reads; on CPUs with AMX (cpu isa "amx")
// the tiles take the bulk of each product (cpu_gemm_amx.h). Torch-free. Used by the fused
// lm_head + log-softmax (logprobs/) and the grouped MoE GEMM (moe/).
#pragma once

#include <cstdint>

namespace pykernels::gemm {

// Width (columns) of a packed B panel: two 16-lane fp32 accumulators per row of the micro-tile.
constexpr int64_t kPanel = 32;

// True when the CPU has the AVX-512 BF16 dot-product instruction (vdpbf16ps) the GEMM needs.
bool has_bf16_gemm();

// Packed "B" operands of the GEMM, [ceil(cols / kPanel)][ceil(k / 2)][kPanel] pairs of bf16
// (uint32: element k in the low half, k + 1 in the high half), zero padded. panel_stride() gives
// the uint32 distance between panels.
inline int64_t panel_stride(int64_t k) { return (k + 1) / 2 * kPanel; }
inline int64_t panels(int64_t cols) { return (cols + kPanel - 1) / kPanel; }

// Row stride for an fp32 C the micro-kernel accumulates into: an odd number of cache lines. With
// 2048 or 4096 columns the rows of a 12-row C tile would be 4 KiB multiples apart and all land in
// one L1 set, evicting each other and their prefetched successors; an odd line stride walks them
// through every set.
inline int64_t padded_ld(int64_t cols) {
  const int64_t lines = (cols + 15) / 16;
  return (lines % 2 == 0 ? lines + 1 : lines) * 16;
}

// B[k][c] = src[c][k] for src [cols][k] (row stride ld): e.g. rows of hidden become the columns
// of logits^T = W h^T.
void pack_transposed(const uint16_t* src, int64_t cols, int64_t k, int64_t ld, uint32_t* dst);

// pack_transposed for rows scattered in memory: column c of B is the row at base + row_offsets[c]
// (element offsets, k elements each), e.g. the tokens routed to one expert, gathered while packed.
void pack_transposed_gather(const uint16_t* base, const int64_t* row_offsets, int64_t cols, int64_t k,
                            uint32_t* dst);

// B[k][c] = src[k][c] for src [k][cols] (row stride ld), rows beyond `k` up to `k_padded` zero:
// e.g. hidden for dW = dz^T h, a block of W for dh = dz W.
void pack_rows(const uint16_t* src, int64_t k, int64_t k_padded, int64_t cols, int64_t ld, uint32_t* dst);

// C[M, N] (+)= A[M, K] B[K, N] in fp32. A: bf16 rows (row stride lda, K contiguous; an odd K reads
// no element past K); B: packed as above (panel_stride between panels); C: row stride ldc, only
// columns < N are touched. accumulate = false overwrites C.
void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint32_t* b,
               int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate);

// A packed ahead for several gemm_bf16 calls that read the same rows (an expert's rows against each
// column block of its weight): on the AMX path every call otherwise copies A into the tiles' order,
// as much memory traffic as packing the weight block it multiplies. prepacked_a_size: uint16
// elements, 0 where gemm_bf16 packs nothing (cpu isa not "amx", K < 32): then pass null.
int64_t prepacked_a_size(int64_t m, int64_t k);
void prepack_a(const uint16_t* a, int64_t lda, int64_t m, int64_t k, uint16_t* dst);

// gemm_bf16 with A also given as prepack_a(a, lda, m, k) wrote it (or null); a is still read for
// what the tiles leave to AVX-512.
void gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* a_prepacked,
               const uint32_t* b, int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate);

}  // namespace pykernels::gemm
