// NF4 quantization shared by the CPU and CUDA implementations. No torch headers: this file is
// included by .cu sources that must compile against a CPU-only torch (see CMakeLists.txt).
//
// Format (bitsandbytes-compatible): the flat input is cut into blocks of `blocksize` values;
// each block stores absmax (fp32) and one 4-bit code per value, two codes per byte, high nibble
// first. Optionally absmax itself is 8-bit quantized in blocks of 256 with the signed dynamic
// map ("double quantization", QLoRA https://arxiv.org/abs/2305.14314).
#pragma once

#include <cstdint>

#include "common/dtype.h"
#include "common/two_way_choice.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::nf4 {

// NF4 values (bitsandbytes get_4bit_type("nf4")), ascending.
inline constexpr float kCode[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

// Decision boundaries, rounded as torch rounds (code[i] + code[i+1]) / 2 in fp32. A value v gets
// the code count_i(!(kMidpoint[i] >= v)): ties go down, NaN gets 15 (torch.bucketize).
inline constexpr float midpoint(int i) { return (kCode[i] + kCode[i + 1]) / 2.0f; }
inline constexpr float kMidpoint[15] = {
    midpoint(0), midpoint(1), midpoint(2),  midpoint(3),  midpoint(4),
    midpoint(5), midpoint(6), midpoint(7),  midpoint(8),  midpoint(9),
    midpoint(10), midpoint(11), midpoint(12), midpoint(13), midpoint(14),
};

inline constexpr uint8_t kPadCode = 7;  // 0.0: fills the low nibble of an odd numel's last byte
inline constexpr int kDynamicLutSize = 65536;  // bitsandbytes' CPU 8-bit lookup resolution

// torch clamps absmax with min=1e-38 (a double) before the reciprocal; this is that value in fp32.
inline constexpr float kAbsmaxFloor = static_cast<float>(1e-38);

using pykernels::DType;

inline constexpr int64_t num_blocks(int64_t numel, int64_t blocksize) {
  return (numel + blocksize - 1) / blocksize;
}

struct QuantizeParams {
  const void* x;      // [numel] fp32/fp16/bf16, contiguous
  DType x_dtype;
  int64_t numel;
  int64_t blocksize;  // power of two in [32, 4096]
  uint8_t* packed;    // [ceil(numel / 2)]
  float* absmax;      // [num_blocks]
};

// Per-block scale: absmax[b], or with double quantization
// nested_code[absmax_q[b]] * nested_absmax[b / nested_blocksize] + *nested_offset (two roundings).
struct BlockScales {
  const float* absmax = nullptr;          // [num_blocks], null when double-quantized
  const uint8_t* absmax_q = nullptr;      // [num_blocks]
  const float* nested_absmax = nullptr;   // [ceil(num_blocks / nested_blocksize)]
  const float* nested_code = nullptr;     // [256]
  const float* nested_offset = nullptr;   // [1]
  int64_t nested_blocksize = 256;
};

struct DequantizeParams {
  const uint8_t* packed;  // [ceil(numel / 2)]
  BlockScales scales;
  int64_t numel;
  int64_t blocksize;
  void* out;              // [numel] of out_dtype
  DType out_dtype;
};

// bitsandbytes' 8-bit blockwise quantization with a 256-entry code (used for absmax).
struct Dynamic8QuantizeParams {
  const float* x;       // [numel]
  const float* offset;  // [1] or null: quantize x - *offset (one fp32 subtraction, as torch does)
  const float* code;    // [256], ascending
  int64_t numel;
  int64_t blocksize;
  uint8_t* q;         // [numel]
  float* absmax;      // [num_blocks]
};

struct Dynamic8DequantizeParams {
  const uint8_t* q;      // [numel]
  const float* absmax;   // [num_blocks]
  const float* code;     // [256]
  int64_t numel;
  int64_t blocksize;
  float* out;            // [numel]
};

// The QLoRA GEMM's scale operand (nf4_gemm_sm90.h): out [groups, rows] fp32, out[g][i] = the absmax
// (decoded when double-quantized) of block i * groups + g of a weight of `rows` rows of `groups`
// whole blocks each.
struct TransposedScalesParams {
  BlockScales scales;
  int64_t rows, groups;
  float* out;
};

// PYKERNELS_NF4_DEQUANT, read by launch_dequantize on every call (benchmarks/tile_sweep.py times both
// ways in one process): `warps` (the default), a warp per 1024 values with one 16-byte load per lane,
// staged in shared memory, and one scale lookup per block (nf4_layout.h, kWarpChunkValues), for
// power-of-two blocksizes and 16-byte aligned tensors (else units); `units`, a thread per 16-byte
// store unit with four units' 4-byte loads in flight. On an H100 warps took 1.21-1.24x less time than
// units at 4096 x 4096, 4096 x 14336 and 128 experts of 2048 x 768 (benchmarks/results/h100.md,
// 2026-11-27 second lease).
// Sets *units (the other side, as every two-way knob sets); null on success, else the message.
inline const char* dequantize_units_for(const char* setting, bool* units) {
  return two_way_choice(setting, "warps", "units", "PYKERNELS_NF4_DEQUANT must be warps (the default) or units",
                        units);
}

// CUDA launchers (nf4.cu). Each returns nullptr on success or a message naming what failed.
const char* launch_quantize(const QuantizeParams& params, cudaStream_t stream);
const char* launch_dequantize(const DequantizeParams& params, cudaStream_t stream);
const char* launch_dynamic8_quantize(const Dynamic8QuantizeParams& params, cudaStream_t stream);
const char* launch_dynamic8_dequantize(const Dynamic8DequantizeParams& params, cudaStream_t stream);
const char* launch_transposed_scales(const TransposedScalesParams& params, cudaStream_t stream);

}  // namespace pykernels::nf4
