// How the fused logprobs walk the vocabulary and the tokens: chunks of kVocabChunk rows of W and
// kTokenChunk tokens (logprobs_cuda_torch.cpp), each (token chunk, vocab chunk) logits tile with
// rows padded to a multiple of 8 floats, and where a token's target falls inside a vocab chunk
// (logprobs.cu). The last chunk holds the remainder; no chunk is empty.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels::logprobs {

inline constexpr int64_t kTokenChunk = 4096;
inline constexpr int64_t kVocabChunk = 8192;  // fp32 tile 128 MiB at most
// The backward with a frozen lm_head walks tokens outermost, holding an fp32 dh buffer of this many
// rows and a dz tile of this many rows (8 + 8 MiB at H 4096 on Hopper): the working memory stays
// under 1/16 of chunked torch's at V 32000 (its 1024-token fp32 logits, log-softmax and gradient:
// 375 MiB). 512 rows still fill an H100 with the dz GEMM's 128 x 128 tiles (4 x 64 per vocab chunk).
inline constexpr int64_t kFrozenTokenChunk = 512;

// Chunk i of [0, extent) in chunks of `chunk`: [begin, begin + size).
struct Chunk {
  int64_t begin, size;
};

PYKERNELS_HOST_DEVICE inline int64_t chunk_count(int64_t extent, int64_t chunk) { return ceil_div(extent, chunk); }

PYKERNELS_HOST_DEVICE inline Chunk chunk_at(int64_t extent, int64_t chunk, int64_t i) {
  const int64_t begin = i * chunk;
  return {begin, min_i64(chunk, extent - begin)};
}

// Row length of a logits tile: a multiple of 8 fp32 values keeps every row 16-byte aligned
// (CUTLASS's tensor-core path).
PYKERNELS_HOST_DEVICE inline int64_t padded_row_length(int64_t cols) { return (cols + 7) / 8 * 8; }

// The Hopper path (logprobs_sm90.cu) keeps no logits tile, so it walks the vocabulary in larger
// chunks (fewer, fuller GEMMs); its GEMM tiles are kSm90Tile vocabulary entries wide and 128 or 256
// tokens tall (logprobs_sm90.h; the kernels assert it). For each (token chunk, vocab chunk) the
// statistics GEMM leaves one softmax partial per (token, 128-entry vocab tile), in three fp32 planes
// of [vocab_tiles][rows_padded]: entry (row, tile) at tile * rows_padded + row, rows padded to
// kSm90RowPad, a whole number of either tile's rows (CUTLASS's layout of a per-tile column
// reduction over a problem of rows_padded rows; the padding rows hold garbage and are never read).
inline constexpr int64_t kSm90VocabChunk = 65536;
inline constexpr int64_t kSm90Tile = 128;
inline constexpr int64_t kSm90RowPad = 256;

PYKERNELS_HOST_DEVICE constexpr int64_t vocab_tiles(int64_t cols) { return ceil_div(cols, kSm90Tile); }
PYKERNELS_HOST_DEVICE constexpr int64_t partial_rows(int64_t tokens) {
  return ceil_div(tokens, kSm90RowPad) * kSm90RowPad;
}
PYKERNELS_HOST_DEVICE constexpr int64_t partial_index(int64_t row, int64_t tile, int64_t rows_padded) {
  return tile * rows_padded + row;
}

// Column of `target` in the chunk of `cols` vocabulary entries starting at v0, or -1 when the
// target lies outside it (other chunks, ignore_index, out-of-vocabulary targets).
PYKERNELS_HOST_DEVICE inline int64_t target_column(int64_t target, int64_t v0, int64_t cols) {
  const int64_t column = target - v0;
  return column >= 0 && column < cols ? column : -1;
}

// A target that is neither ignore_index nor a vocabulary entry: its logit is never picked.
PYKERNELS_HOST_DEVICE inline bool target_out_of_vocab(int64_t target, int64_t ignore_index, int64_t vocab) {
  return target != ignore_index && (target < 0 || target >= vocab);
}

}  // namespace pykernels::logprobs
