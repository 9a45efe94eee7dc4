// CPU kernels for LoRA's rank-r products, fp32 on raw pointers, one block of rows at a time
// (callers split rows across threads and convert 16-bit activations to fp32 in cache-sized
// chunks). BLAS runs these skinny shapes (an inner or outer dimension of r, e.g. 16) at a few
// percent of peak, which made LoRA cost as much as the base GEMM; these are written for them:
// broadcast-FMA over the long dimension, rows blocked so each load of A / B or of a gradient
// accumulator serves several rows. AVX-512 with a portable fallback.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace pykernels::lora::cpu {

// dst[i] = fp32(src[i]) for i < count: chunks of 16-bit activations are converted into fp32 scratch
// buffers that the kernels below read.
void to_fp32(const void* src, DType src_dtype, int64_t count, float* dst);

// xa[i, :r] = sum_k x[i, k] * a_t[k, :r] for rows i < rows. x [rows, k]; a_t = A^T [k, r]; xa [rows, r].
void low_rank_down(const float* x, int64_t rows, int64_t k, const float* a_t, int64_t r, float* xa);

// Columns per tile of the packed B^T that low_rank_up reads.
constexpr int64_t kUpColumnTile = 128;

// out[i, :n] = round(sum_j xa[i, j] * bt[j, :n] + bias[:n]) for rows i < rows, summed in fp32 and
// rounded once to out_dtype. out [rows, n]; xa [rows, r]; bias [n] or null; bt = B^T [r, n] (any
// scaling folded in) packed as column tiles [ceil(n / kUpColumnTile), r, kUpColumnTile], zero
// padded: each tile contiguous, so it stays in L1 across rows (rows of a plain [r, n] B^T are
// n floats apart and, for n a multiple of 1024, all fall in the same few L1 sets).
void low_rank_up(void* out, DType out_dtype, int64_t rows, int64_t n, const float* xa, int64_t r, const float* bt,
                 const float* bias);

// One pass over dy [rows, n]: dxa[i, :r] = scale * sum_c dy[i, c] * b[c, :r] (written), and
// db[c, :r] += scale * sum_i dy[i, c] * xa[i, :r] (accumulated: a per-thread partial [n, r]).
void low_rank_backward(const float* dy, int64_t rows, int64_t n, const float* b, const float* xa, int64_t r,
                       float scale, float* dxa, float* db);

// da[j, :k] += sum_i dxa[i, j] * x[i, :k] (accumulated: a per-thread partial [r, k]); x [rows, k].
void lora_a_grad(const float* x, int64_t rows, int64_t k, const float* dxa, int64_t r, float* da);

}  // namespace pykernels::lora::cpu
