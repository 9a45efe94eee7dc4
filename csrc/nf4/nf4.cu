// NF4 CUDA kernels. Memory-bound: each quantize thread moves 8 values, each dequantize thread one
// 16-byte store per unit of 8 (16-bit out) or 4 (fp32) values (by units, or by warp chunks with
// 16-byte loads: PYKERNELS_NF4_DEQUANT, nf4.h); the aim is >= 85% of copy bandwidth.
// Results are bit-identical to the CPU kernels (and so to bitsandbytes 0.50 on CPU): every rounding
// step is an explicit _rn intrinsic, so nvcc's default multiply-add contraction cannot change a bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/cuda_convert.cuh"
#include "common/cuda_launch.cuh"
#include "common/tails.h"
#include "nf4/nf4.h"
#include "nf4/nf4_layout.h"

namespace pykernels::nf4 {
namespace {

using Packed4 = uint32_t;  // 8 codes = 4 bytes: one quantize thread's output

constexpr int kQuantValuesPerThread = 8;     // 32 B of fp32 / 16 B of bf16 per thread
constexpr int kDequantUnitsInFlight = 4;     // loads a thread issues before it decodes (DequantUnit)
constexpr int kThreads = 256;

__constant__ float c_code[16] = {
    kCode[0], kCode[1], kCode[2],  kCode[3],  kCode[4],  kCode[5],  kCode[6],  kCode[7],
    kCode[8], kCode[9], kCode[10], kCode[11], kCode[12], kCode[13], kCode[14], kCode[15],
};
__constant__ float c_midpoint[15] = {
    kMidpoint[0], kMidpoint[1], kMidpoint[2],  kMidpoint[3],  kMidpoint[4],
    kMidpoint[5], kMidpoint[6], kMidpoint[7],  kMidpoint[8],  kMidpoint[9],
    kMidpoint[10], kMidpoint[11], kMidpoint[12], kMidpoint[13], kMidpoint[14],
};

__device__ __forceinline__ float nan_propagating_max(float a, float b) {
  return (a > b || isnan(a)) ? a : b;
}

__device__ __forceinline__ uint32_t nf4_code_of(float v) {
  v = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);  // NaN stays NaN
  uint32_t code = 0;
#pragma unroll
  for (int i = 0; i < 15; ++i) code += !(c_midpoint[i] >= v);  // NaN counts every midpoint: 15
  return code;
}

// ------------------------------------------------------------------ quantize
// A group of blocksize / 8 consecutive threads owns one quantization block; groups of up to 32
// threads reduce absmax with warp shuffles, larger groups (blocksize >= 512) through shared memory.
template <typename T>
__global__ void __launch_bounds__(512) quantize_kernel(const T* __restrict__ x,  // [numel]
                                                       int64_t numel, int blocksize,
                                                       uint8_t* __restrict__ packed,   // [ceil(numel/2)]
                                                       float* __restrict__ absmax) {   // [num_blocks]
  __shared__ float warp_max[16];
  const int group_threads = blocksize / kQuantValuesPerThread;
  const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t first = thread * kQuantValuesPerThread;
  const int64_t block = block_of(first, blocksize);

  float values[kQuantValuesPerThread];
  const bool vector_ok = whole_vector_in_range(first, kQuantValuesPerThread, numel) && is_aligned(x, 16);
  if (vector_ok) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = reinterpret_cast<const float4*>(x + first)[0];
      const float4 b = reinterpret_cast<const float4*>(x + first)[1];
      values[0] = a.x; values[1] = a.y; values[2] = a.z; values[3] = a.w;
      values[4] = b.x; values[5] = b.y; values[6] = b.z; values[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + first);
      const T* halves = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kQuantValuesPerThread; ++i) values[i] = to_float(halves[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kQuantValuesPerThread; ++i)
      values[i] = first + i < numel ? to_float(x[first + i]) : 0.0f;  // pad: |0| leaves absmax as is
  }

  float local_max = 0.0f;
#pragma unroll
  for (int i = 0; i < kQuantValuesPerThread; ++i) local_max = nan_propagating_max(fabsf(values[i]), local_max);
  const int warp_width = group_threads < 32 ? group_threads : 32;
  for (int lane_mask = warp_width / 2; lane_mask > 0; lane_mask /= 2)
    local_max = nan_propagating_max(__shfl_xor_sync(0xffffffffu, local_max, lane_mask), local_max);
  float block_max = local_max;
  if (group_threads > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) warp_max[warp] = local_max;
    __syncthreads();
    const int warps_per_group = group_threads / 32;
    const int group_first_warp = warp - warp % warps_per_group;
    block_max = warp_max[group_first_warp];
    for (int w = 1; w < warps_per_group; ++w) block_max = nan_propagating_max(warp_max[group_first_warp + w], block_max);
  }
  if (first >= numel) return;

  const bool partial = block_is_partial(block, blocksize, numel);
  const float clamped = block_max < kAbsmaxFloor ? kAbsmaxFloor : block_max;  // NaN passes
  const float reciprocal = __frcp_rn(clamped);
  if (first % blocksize == 0) absmax[block] = partial ? clamped : block_max;

  Packed4 codes = 0;
#pragma unroll
  for (int i = 0; i < kQuantValuesPerThread; ++i) {
    const float scaled = partial ? __fdiv_rn(values[i], clamped) : __fmul_rn(values[i], reciprocal);
    const uint32_t code = first + i < numel ? nf4_code_of(scaled) : kPadCode;
    codes |= code << packed_word_shift(i);  // byte k holds values 2k (high nibble) and 2k+1 (low)
  }
  const int64_t byte = packed_byte_of(first);
  if (whole_vector_in_range(first, kQuantValuesPerThread, numel) && is_aligned(packed, 4)) {
    *reinterpret_cast<Packed4*>(packed + byte) = codes;
  } else {
    const int64_t bytes = elements_in_range(byte, kQuantValuesPerThread / 2, packed_bytes(numel));
    for (int64_t k = 0; k < bytes; ++k) packed[byte + k] = static_cast<uint8_t>(codes >> (8 * k));
  }
}

// ------------------------------------------------------------------ dequantize
// Block `block`'s absmax, the nested block found by `nested` (divider(s.nested_blocksize)), by a
// shift when kShift.
template <bool kShift>
__device__ __forceinline__ float block_scale(const BlockScales& s, int64_t block, const Divider& nested) {
  if (s.absmax != nullptr) return s.absmax[block];
  return decode_absmax(s.nested_code[s.absmax_q[block]], s.nested_absmax[divide_as<kShift>(nested, block)],
                       *s.nested_offset);
}

// One thread's unit of work: the values of one 16-byte store of T (8 bf16 / fp16, 4 fp32), decoded
// from the 4 / 2 packed bytes of one load. Consecutive threads take consecutive units, so a warp's
// store covers one contiguous 512 bytes in whole 32-byte sectors (with 32 values per thread, as
// before, each store instruction half-filled 32 sectors 64 bytes apart: twice the L2 write requests,
// measured at 72-77% of copy bandwidth on an H100). Every unit lies in one quantization block
// (8 divides blocksize).
template <typename T>
struct DequantUnit {
  static constexpr int kValues = 16 / static_cast<int>(sizeof(T));
  using Codes = std::conditional_t<kValues == 8, uint32_t, uint16_t>;  // kValues / 2 packed bytes
};

template <typename T>
__device__ __forceinline__ void decode_and_store(typename DequantUnit<T>::Codes codes, float scale,
                                                 const float* code, T* out) {
  constexpr int kValues = DequantUnit<T>::kValues;
  float v[kValues];
#pragma unroll
  for (int k = 0; k < kValues / 2; ++k) {
    const uint8_t byte = static_cast<uint8_t>(codes >> (8 * k));  // little-endian: byte k, values 2k, 2k + 1
    v[2 * k] = dequantize_value(code[high_code(byte)], scale);
    v[2 * k + 1] = dequantize_value(code[low_code(byte)], scale);
  }
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint4 raw;
    T* halves = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kValues; ++i) halves[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(out) = raw;
  }
}

// Element i alone (tails, unaligned tensors, a last partial chunk), given its block's scale.
template <typename T>
__device__ __forceinline__ void dequantize_element(const uint8_t* packed, int64_t i, float scale, const float* code,
                                                   T* out) {
  out[i] = from_float<T>(dequantize_value(code[code_of_element(packed[packed_byte_of(i)], i)], scale));
}

// Memory-bound: every thread issues the loads of kDequantUnitsInFlight units before it decodes any
// (several loads in flight per thread), then writes each unit with one 16-byte store. Tails and
// misaligned tensors take the element-wise path. A unit's block and nested block come from shifts
// (Divider): with a 64-bit division per 8 values, four times the old kernel's per value, this layout
// measured 66-71% of copy bandwidth on an H100 where the old one had 72-77% (h100.md, 2026-11-27).
template <typename T, bool kShift>  // kShift: blocksize (and nested blocksize) are powers of two
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ packed,
                                                              BlockScales scales, int64_t numel, Divider block_div,
                                                              Divider nested_div, T* __restrict__ out) {
  using Codes = typename DequantUnit<T>::Codes;
  constexpr int kValues = DequantUnit<T>::kValues;
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = c_code[threadIdx.x];
  __syncthreads();
  const int64_t units = ceil_div(numel, kValues);
  const bool vector_ok = is_aligned(packed, sizeof(Codes)) && is_aligned(out, 16);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; base < units;
       base += stride * kDequantUnitsInFlight) {
    Codes loaded[kDequantUnitsInFlight];
    float scale[kDequantUnitsInFlight];
#pragma unroll
    for (int u = 0; u < kDequantUnitsInFlight; ++u) {
      const int64_t first = (base + u * stride) * kValues;
      if (vector_ok && whole_vector_in_range(first, kValues, numel)) {
        loaded[u] = *reinterpret_cast<const Codes*>(packed + packed_byte_of(first));
        scale[u] = block_scale<kShift>(scales, divide_as<kShift>(block_div, first), nested_div);
      }
    }
#pragma unroll
    for (int u = 0; u < kDequantUnitsInFlight; ++u) {
      const int64_t unit = base + u * stride;
      if (unit >= units) break;
      const int64_t first = unit * kValues;
      if (vector_ok && whole_vector_in_range(first, kValues, numel)) {
        decode_and_store(loaded[u], scale[u], code, out + first);
      } else {
        const float tail_scale = block_scale<kShift>(scales, divide_as<kShift>(block_div, first), nested_div);
        const int64_t end = first + elements_in_range(first, kValues, numel);
        for (int64_t i = first; i < end; ++i) dequantize_element(packed, i, tail_scale, code, out);
      }
    }
  }
}

// ------------------------------------------------------------------ dequantize by warp chunks
// PYKERNELS_NF4_DEQUANT=warps (nf4.h; the layout: nf4_layout.h, kWarpChunkValues). A warp issues, for
// each of kWarpChunksInFlight chunks, one 16-byte load of packed codes per lane and the decode of at
// most one block scale per lane, before it decodes anything; then per chunk the codes go through
// shared memory so that each 16-byte store instruction writes 512 contiguous bytes, and each store
// unit takes its scale from the lane that decoded it (a shuffle): per 8 bf16 values, 0.25 loads of
// codes and at most one scale decode per block, against the units kernel's one load of codes and one
// scale decode per unit. Power-of-two blocksizes (shifts) and 16-byte aligned packed and out only
// (the launcher checks); the last, partial chunk goes value by value.
constexpr int kWarpChunksInFlight = 2;
constexpr int kWarpsPerBlock = kThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads) dequantize_warps_kernel(const uint8_t* __restrict__ packed,
                                                                    BlockScales scales, int64_t numel,
                                                                    Divider block_div, Divider nested_div,
                                                                    T* __restrict__ out) {
  using Codes = typename DequantUnit<T>::Codes;
  constexpr int kValues = DequantUnit<T>::kValues;
  constexpr int kUnitsPerLane = static_cast<int>(kWarpChunkValues) / (32 * kValues);  // 4 (16-bit out), 8 (fp32)
  constexpr int kPackedPerLane = static_cast<int>(kWarpChunkValues) / 2 / 32;          // 16 bytes
  static_assert(kPackedPerLane == 16, "one 16-byte load of codes per lane and chunk");
  __shared__ float code[16];
  __shared__ __align__(16) uint8_t staged[kWarpsPerBlock][kWarpChunksInFlight][kWarpChunkValues / 2];
  if (threadIdx.x < 16) code[threadIdx.x] = c_code[threadIdx.x];
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int shift = block_div.shift;
  const int64_t chunks = ceil_div(numel, kWarpChunkValues);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t base = int64_t(blockIdx.x) * kWarpsPerBlock + warp; base < chunks;
       base += warps * kWarpChunksInFlight) {
    uint4 loaded[kWarpChunksInFlight];
    float scale[kWarpChunksInFlight];
#pragma unroll
    for (int c = 0; c < kWarpChunksInFlight; ++c) {
      const int64_t chunk = base + c * warps, c0 = chunk * kWarpChunkValues;
      if (chunk < chunks && c0 + kWarpChunkValues <= numel) {
        loaded[c] = *reinterpret_cast<const uint4*>(packed + packed_byte_of(c0) + lane * kPackedPerLane);
        scale[c] = warp_lane_has_scale(c0, lane, shift) ? block_scale<true>(scales, (c0 >> shift) + lane, nested_div)
                                                        : 0.0f;
      }
    }
    __syncwarp();  // every lane is done reading the staged codes of the previous pass
#pragma unroll
    for (int c = 0; c < kWarpChunksInFlight; ++c) {
      const int64_t chunk = base + c * warps, c0 = chunk * kWarpChunkValues;
      if (chunk >= chunks) break;  // the same for the whole warp
      if (c0 + kWarpChunkValues > numel) {
        for (int64_t i = c0 + lane; i < numel; i += 32)
          dequantize_element(packed, i, block_scale<true>(scales, i >> shift, nested_div), code, out);
        continue;
      }
      uint8_t* stage = staged[warp][c];
      *reinterpret_cast<uint4*>(stage + lane * kPackedPerLane) = loaded[c];
      __syncwarp();
#pragma unroll
      for (int u = 0; u < kUnitsPerLane; ++u) {
        const int64_t offset = warp_unit_offset(u, lane, kValues);
        const Codes codes = *reinterpret_cast<const Codes*>(stage + packed_byte_of(offset));
        const float unit_scale = __shfl_sync(0xffffffffu, scale[c], warp_scale_lane(c0, offset, shift));
        decode_and_store<T>(codes, unit_scale, code, out + c0 + offset);
      }
    }
  }
}

// ------------------------------------------------------------------ 8-bit dynamic (absmax)
// One CTA per block. Reproduces bitsandbytes' CPU table lookup without the table: entry i of the
// table is the number of code midpoints below -1 + 2i / 65535, computed here directly.
__global__ void __launch_bounds__(kThreads) dynamic8_quantize_kernel(const float* __restrict__ x,
                                                                     const float* __restrict__ offset,  // [1] or null
                                                                     const float* __restrict__ code,
                                                                     int64_t numel, int64_t blocksize,
                                                                     uint8_t* __restrict__ q,
                                                                     float* __restrict__ absmax) {
  __shared__ float midpoints[255];
  __shared__ float warp_max[kThreads / 32];
  for (int i = threadIdx.x; i < 255; i += blockDim.x)
    midpoints[i] = __fmul_rn(0.5f, __fadd_rn(code[i], code[i + 1]));
  const int64_t begin = int64_t(blockIdx.x) * blocksize;
  const int64_t end = begin + blocksize < numel ? begin + blocksize : numel;
  const float shift = offset != nullptr ? *offset : 0.0f;  // x - 0 is x, bit for bit
  const auto value = [&](int64_t i) { return __fsub_rn(x[i], shift); };
  float local_max = 0.0f;  // bitsandbytes: NaN never wins and the result is at least 0
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) local_max = fmaxf(local_max, fabsf(value(i)));
  for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2)
    local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, lane_mask));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = local_max;
  __syncthreads();
  float block_max = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) block_max = fmaxf(block_max, warp_max[w]);
  if (threadIdx.x == 0) absmax[blockIdx.x] = block_max;
  const float reciprocal = __frcp_rn(block_max);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if (block_max == 0.0f) {
      q[i] = 0;
      continue;
    }
    float v = __fmul_rn(value(i), reciprocal);
    v = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
    const float position = __fmaf_rn(__fmul_rn(__fadd_rn(v, 1.0f), 0.5f), float(kDynamicLutSize - 1), 0.5f);
    const int index = isnan(position) ? 0 : static_cast<int>(position) & 0xFFFF;
    const float grid = __fadd_rn(__fdiv_rn(2.0f * float(index), float(kDynamicLutSize - 1)), -1.0f);
    int lo = 0, hi = 255;  // first midpoint that is not below grid
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (midpoints[mid] < grid) lo = mid + 1; else hi = mid;
    }
    q[i] = static_cast<uint8_t>(lo);
  }
}

__global__ void dynamic8_dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ absmax,
                                           const float* __restrict__ code, int64_t numel, int64_t blocksize,
                                           float* __restrict__ out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __fmul_rn(code[q[i]], absmax[i / blocksize]);
}

// One thread per output, consecutive threads on consecutive outputs (the reads gather: 1/64 of the
// weight's elements at most, once per call).
__global__ void transposed_scales_kernel(BlockScales scales, int64_t rows, int64_t groups, float* __restrict__ out) {
  const int64_t total = rows * groups;
  const Divider nested{scales.nested_blocksize, -1};  // one lookup per 64 weights: a division will do
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < total; o += int64_t(gridDim.x) * blockDim.x)
    out[o] = block_scale<false>(scales, transposed_scale_block(o, rows, groups), nested);
}

}  // namespace

const char* launch_quantize(const QuantizeParams& p, cudaStream_t stream) {
  if (p.blocksize < 32 || p.blocksize > 4096 || (p.blocksize & (p.blocksize - 1)) != 0)
    return "nf4 quantize: blocksize must be a power of two in [32, 4096] (bitsandbytes' range)";
  // Threads cover whole blocks so every group sees its full block; CTAs hold whole groups.
  const int group_threads = static_cast<int>(p.blocksize / kQuantValuesPerThread);
  const int threads = group_threads > kThreads ? group_threads : kThreads;
  const int64_t total_threads = num_blocks(p.numel, p.blocksize) * group_threads;
  const int64_t ctas = (total_threads + threads - 1) / threads;
  if (ctas > INT32_MAX) return "nf4 quantize: too many blocks for one launch (more than 2^31 - 1 CTAs)";
  const dim3 grid(static_cast<unsigned>(ctas));
  switch (p.x_dtype) {
    case DType::kFloat32:
      quantize_kernel<float><<<grid, threads, 0, stream>>>(static_cast<const float*>(p.x), p.numel,
                                                           int(p.blocksize), p.packed, p.absmax);
      break;
    case DType::kFloat16:
      quantize_kernel<__half><<<grid, threads, 0, stream>>>(static_cast<const __half*>(p.x), p.numel,
                                                            int(p.blocksize), p.packed, p.absmax);
      break;
    case DType::kBFloat16:
      quantize_kernel<__nv_bfloat16><<<grid, threads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(p.x), p.numel, int(p.blocksize), p.packed, p.absmax);
      break;
  }
  return launch_status("nf4 quantize: kernel launch failed");  // blocksize was checked above
}

namespace {

// One element type's launch, by shifts when every divisor is a power of two (bitsandbytes' always are);
// by warp chunks when `warps` asks for it and the shifts and 16-byte alignment allow.
template <typename T>
void launch_dequantize_as(const DequantizeParams& p, const Divider& block_div, const Divider& nested_div, bool warps,
                          cudaStream_t stream) {
  const bool shifts = dequantize_by_shifts(block_div, nested_div, /*double_quant=*/p.scales.absmax == nullptr);
  if (warps && shifts && is_aligned(p.packed, 16) && is_aligned(p.out, 16)) {
    const int64_t passes = ceil_div(ceil_div(p.numel, kWarpChunkValues), kWarpChunksInFlight);
    dequantize_warps_kernel<T><<<grid_for(passes * 32, kThreads), kThreads, 0, stream>>>(
        p.packed, p.scales, p.numel, block_div, nested_div, static_cast<T*>(p.out));
    return;
  }
  const int grid = grid_for(ceil_div(ceil_div(p.numel, DequantUnit<T>::kValues), kDequantUnitsInFlight), kThreads);
  if (shifts) {
    dequantize_kernel<T, true><<<grid, kThreads, 0, stream>>>(p.packed, p.scales, p.numel, block_div, nested_div,
                                                              static_cast<T*>(p.out));
  } else {
    dequantize_kernel<T, false><<<grid, kThreads, 0, stream>>>(p.packed, p.scales, p.numel, block_div, nested_div,
                                                               static_cast<T*>(p.out));
  }
}

}  // namespace

const char* launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  // A unit (8 or 4 values) must lie in one block: bitsandbytes' blocksizes, powers of two in [32,
  // 4096], are multiples of 8; the launch itself has no other limit (grid-stride loop).
  if (p.blocksize < 32 || p.blocksize % 32 != 0)
    return "nf4 dequantize: blocksize must be a multiple of 32 (a power of two in [32, 4096])";
  bool units = false;
  if (const char* error = dequantize_units_for(std::getenv("PYKERNELS_NF4_DEQUANT"), &units)) return error;
  const bool warps = !units;
  const Divider block_div = divider(p.blocksize), nested_div = divider(p.scales.nested_blocksize);
  switch (p.out_dtype) {
    case DType::kFloat32: launch_dequantize_as<float>(p, block_div, nested_div, warps, stream); break;
    case DType::kFloat16: launch_dequantize_as<__half>(p, block_div, nested_div, warps, stream); break;
    case DType::kBFloat16: launch_dequantize_as<__nv_bfloat16>(p, block_div, nested_div, warps, stream); break;
  }
  return launch_status("nf4 dequantize: kernel launch failed");
}

const char* launch_dynamic8_quantize(const Dynamic8QuantizeParams& p, cudaStream_t stream) {
  const int64_t blocks = num_blocks(p.numel, p.blocksize);
  if (blocks > INT32_MAX) return "dynamic8 quantize: too many blocks for one launch";
  dynamic8_quantize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p.x, p.offset, p.code, p.numel,
                                                                                  p.blocksize, p.q, p.absmax);
  return launch_status("dynamic8 quantize: kernel launch failed");
}

const char* launch_dynamic8_dequantize(const Dynamic8DequantizeParams& p, cudaStream_t stream) {
  dynamic8_dequantize_kernel<<<grid_for(p.numel, kThreads), kThreads, 0, stream>>>(p.q, p.absmax, p.code, p.numel,
                                                                                   p.blocksize, p.out);
  return launch_status("dynamic8 dequantize: kernel launch failed");
}

const char* launch_transposed_scales(const TransposedScalesParams& p, cudaStream_t stream) {
  transposed_scales_kernel<<<grid_for(p.rows * p.groups, kThreads), kThreads, 0, stream>>>(p.scales, p.rows, p.groups,
                                                                                          p.out);
  return launch_status("nf4 transposed scales: kernel launch failed");
}

}  // namespace pykernels::nf4
