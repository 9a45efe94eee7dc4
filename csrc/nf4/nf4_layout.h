// Where NF4 element i lives and how its scale is decoded (bitsandbytes' layout): byte i / 2 of
// `packed`, the high nibble for even i and the low nibble for odd i, in quantization block
// i / blocksize; with double quantization the block's absmax is
// nested_code[absmax_q[b]] * nested_absmax[b / nested_blocksize] + nested_offset, two fp32
// roundings. Shared by nf4.cu and the host tests; nf4.h holds the code table and the launchers.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels::nf4 {

PYKERNELS_HOST_DEVICE inline int64_t packed_byte_of(int64_t i) { return i / 2; }

PYKERNELS_HOST_DEVICE inline int64_t packed_bytes(int64_t numel) { return (numel + 1) / 2; }

PYKERNELS_HOST_DEVICE inline int high_code(uint8_t byte) { return byte >> 4; }  // element 2k of byte k

PYKERNELS_HOST_DEVICE inline int low_code(uint8_t byte) { return byte & 0x0F; }  // element 2k + 1

// The 4-bit code of element i, given the byte packed_byte_of(i).
PYKERNELS_HOST_DEVICE inline int code_of_element(uint8_t byte, int64_t i) {
  return i % 2 == 0 ? high_code(byte) : low_code(byte);
}

// Bit offset of code j (0 <= j < 8) of 8 consecutive elements packed into one 32-bit word that is
// stored little-endian: byte k of the word holds codes 2k (high nibble) and 2k + 1 (low nibble).
PYKERNELS_HOST_DEVICE inline int packed_word_shift(int j) { return 4 * (j ^ 1); }

PYKERNELS_HOST_DEVICE inline int64_t block_of(int64_t i, int64_t blocksize) { return i / blocksize; }

// The last block of an input whose numel is not a multiple of blocksize.
PYKERNELS_HOST_DEVICE inline bool block_is_partial(int64_t block, int64_t blocksize, int64_t numel) {
  return (block + 1) * blocksize > numel;
}

// Index into nested_absmax of quantization block `block` (nested blocks of nested_blocksize absmax).
PYKERNELS_HOST_DEVICE inline int64_t nested_block_of(int64_t block, int64_t nested_blocksize) {
  return block / nested_blocksize;
}

// i / d for i >= 0, by a shift when d is a power of two (every bitsandbytes blocksize and nested
// blocksize), else by a division: a 64-bit division is dozens of instructions on the GPU, and the
// dequantize looks up a block (and its nested block) per 8 values.
struct Divider {
  int64_t d;
  int shift;  // log2(d) when d is a power of two, else -1
};

inline Divider divider(int64_t d) {
  int shift = -1;
  if (d > 0 && (d & (d - 1)) == 0)
    for (shift = 0; (int64_t{1} << shift) != d;) ++shift;
  return {d, shift};
}

// kShift (the caller checked by.shift >= 0) compiles to the shift alone: a kernel instantiated for
// each way carries no branch per lookup in its hot loop.
template <bool kShift>
PYKERNELS_HOST_DEVICE inline int64_t divide_as(const Divider& by, int64_t i) {
  if constexpr (kShift) {
    return i >> by.shift;
  } else {
    return i / by.d;
  }
}

// Whether the dequantize runs its shift variant (divide_as<true>): every divisor it looks up by is a
// power of two, the nested blocksize only with double quantization (bitsandbytes' always are).
inline bool dequantize_by_shifts(const Divider& block_div, const Divider& nested_div, bool double_quant) {
  return block_div.shift >= 0 && (!double_quant || nested_div.shift >= 0);
}

// The warp-chunk dequantize (PYKERNELS_NF4_DEQUANT=warps, nf4.cu): a warp takes kWarpChunkValues
// consecutive values at a time. Each lane loads 16 of the chunk's 512 packed bytes (one coalesced
// 512-byte load per warp) into shared memory; lane t's u-th 16-byte store then covers store unit
// 32 u + t, `unit_values` values (8 of 16-bit out, 4 of fp32) from value offset
// warp_unit_offset(u, t, unit_values) of the chunk, so every store instruction of the warp writes 512
// contiguous bytes. Block scales: lane l decodes the scale of block (c0 >> shift) + l of a chunk
// starting at value c0 (a chunk spans at most 32 blocks: blocksize >= 32), and a unit takes its
// scale by a shuffle from lane warp_scale_lane.
inline constexpr int64_t kWarpChunkValues = 1024;

PYKERNELS_HOST_DEVICE constexpr int64_t warp_unit_offset(int u, int lane, int unit_values) {
  return (int64_t{32} * u + lane) * unit_values;
}

PYKERNELS_HOST_DEVICE constexpr int warp_scale_lane(int64_t c0, int64_t offset, int shift) {
  return static_cast<int>(((c0 + offset) >> shift) - (c0 >> shift));
}

// Whether lane `lane` holds a block scale of the chunk at c0 (its block starts before the chunk ends).
PYKERNELS_HOST_DEVICE constexpr bool warp_lane_has_scale(int64_t c0, int lane, int shift) {
  return (c0 >> shift) + lane <= ((c0 + kWarpChunkValues - 1) >> shift);
}

// A double-quantized block's absmax: nested_code[absmax_q] * nested_absmax + nested_offset.
PYKERNELS_HOST_DEVICE inline float decode_absmax(float nested_code_value, float nested_absmax, float nested_offset) {
  return add_rn(mul_rn(nested_code_value, nested_absmax), nested_offset);
}

// The block whose absmax is element o of the QLoRA GEMM's scale operand (nf4_gemm_sm90.h): a weight
// of `rows` rows of `groups` whole blocks each, its absmax transposed to [groups, rows].
PYKERNELS_HOST_DEVICE inline int64_t transposed_scale_block(int64_t o, int64_t rows, int64_t groups) {
  return (o % rows) * groups + o / rows;
}

// A dequantized value: NF4 code value times its block's absmax, one rounding.
PYKERNELS_HOST_DEVICE inline float dequantize_value(float code_value, float absmax) {
  return mul_rn(code_value, absmax);
}

}  // namespace pykernels::nf4
