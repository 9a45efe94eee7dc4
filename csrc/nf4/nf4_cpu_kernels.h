// CPU NF4 kernels on raw pointers. Each function handles a range of whole quantization blocks, so
// callers split the block index space across threads (blocks own disjoint bytes: blocksize is even).
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "nf4/nf4.h"

namespace pykernels::nf4::cpu {

// Blocks [block_begin, block_end) of p (the last block may be partial).
void quantize_blocks(const QuantizeParams& p, int64_t block_begin, int64_t block_end);
void dequantize_blocks(const DequantizeParams& p, int64_t block_begin, int64_t block_end);
// Elements [begin, end) of the flat weight into p.out[0, end - begin) (a chunk of rows at a time).
void dequantize_range(const DequantizeParams& p, int64_t begin, int64_t end);

// bitsandbytes' CPU 8-bit quantizer maps a value v in [-1, 1] to lut[index(v)], where entry i
// holds the number of code midpoints below -1 + 2i / 65535.
using DynamicLut = std::array<uint8_t, kDynamicLutSize>;
// The table for this 256-entry code, built once per distinct code and shared (thread-safe).
std::shared_ptr<const DynamicLut> dynamic_lut(const float* code);
void dynamic8_quantize_blocks(const Dynamic8QuantizeParams& p, const uint8_t* lut,
                              int64_t block_begin, int64_t block_end);
// Elements [begin, end).
void dynamic8_dequantize_range(const Dynamic8DequantizeParams& p, int64_t begin, int64_t end);

}  // namespace pykernels::nf4::cpu
