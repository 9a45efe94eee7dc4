// NF4 codes to bf16 eight at a time from registers, with byte permutes (PTX prmt) and no memory
// lookup: the decode the Hopper QLoRA GEMM runs in its mainloop (nf4/nf4_gemm_sm90.cu), where a
// table in shared memory would compete with wgmma for bandwidth. Shared with the host tests, which
// run the same steps through byte_perm's host twin.
//
// The 16 bf16 values are two byte planes (high and low bytes) of 16 entries; prmt picks 4 bytes
// out of 8, so each plane is two 8-entry halves, and a third prmt picks per byte between the
// halves on the code's bit 3 (CUTLASS's int4 -> fp8 lookup does the same in
// mixed_input_utils.hpp). A word holds 8 codes in bitsandbytes' order (byte j: element 2j in the
// high nibble, 2j + 1 in the low one); the last prmt, which interleaves the planes into bf16 pairs,
// also puts each byte's two elements in order.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace pykernels::nf4 {

// bf16 bits of kCode[c] (nf4.h), rounded to nearest even; host-tested against torch.
inline constexpr uint16_t kCodeBf16[16] = {0xbf80, 0xbf32, 0xbf06, 0xbeca, 0xbe92, 0xbe3d, 0xbdba, 0x0000,
                                           0x3da3, 0x3e25, 0x3e7c, 0x3ead, 0x3ee2, 0x3f10, 0x3f39, 0x3f80};

// PTX prmt.b32 (default mode): byte i of the result is byte (s_i & 7) of the 8 bytes {b, a} (a's
// bytes first), or that byte's sign bit replicated when s_i & 8, for s_i = selector nibble i.
PYKERNELS_HOST_DEVICE inline uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (selector >> (4 * i)) & 0xF;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (s & 7))) & 0xFF;
    if (s & 8) byte = (byte & 0x80) ? 0xFF : 0;
    d |= byte << (8 * i);
  }
  return d;
#endif
}

// One byte plane of kCodeBf16 as four registers: entries 4i .. 4i + 3 in register i, entry 4i in
// the low byte. high: the high bytes, else the low bytes.
struct Nf4Plane {
  uint32_t r[4];
};

PYKERNELS_HOST_DEVICE constexpr Nf4Plane nf4_plane(bool high) {
  Nf4Plane p{};
  for (int e = 0; e < 16; ++e) {
    const uint32_t byte = high ? (kCodeBf16[e] >> 8) : (kCodeBf16[e] & 0xFF);
    p.r[e / 4] |= byte << (8 * (e % 4));
  }
  return p;
}

// Byte i = plane[code_i] for the 4 codes in the selector nibbles of idx (their low 3 bits) and
// half (i + 4 for codes 8..15, else i; see decode_nf4_word_bf16).
PYKERNELS_HOST_DEVICE inline uint32_t nf4_plane_bytes(const Nf4Plane& plane, uint32_t idx, uint32_t half) {
  const uint32_t low = byte_perm(plane.r[0], plane.r[1], idx);   // entries 0..7
  const uint32_t high = byte_perm(plane.r[2], plane.r[3], idx);  // entries 8..15
  return byte_perm(low, high, half);
}

// out[0..3] = bf16 pairs of the 8 codes in `word` (bitsandbytes' packing, stored little-endian):
// out[i] holds element 2i in its low half and 2i + 1 in its high half.
PYKERNELS_HOST_DEVICE inline void decode_nf4_word_bf16(uint32_t word, uint32_t out[4]) {
  constexpr Nf4Plane kHigh = nf4_plane(true), kLow = nf4_plane(false);
  const uint32_t idx = word & 0x77777777u;
  // Selector nibble j: j, plus 4 when nibble j's code is 8..15 (then prmt takes the second operand's
  // byte j). The shift moves each code's bit 3 to bit 2 and 2j to j.
  const uint32_t half = ((word & 0x88888888u) | 0x64206420u) >> 1;
  for (int g = 0; g < 2; ++g) {  // nibbles 4g .. 4g + 3: bytes 2g and 2g + 1 of the word
    const uint32_t hi = nf4_plane_bytes(kHigh, idx >> (16 * g), half >> (16 * g));
    const uint32_t lo = nf4_plane_bytes(kLow, idx >> (16 * g), half >> (16 * g));
    // Nibble 0 of a byte is its low nibble, element 2j + 1: pair (2j, 2j + 1) takes nibbles 1 then 0.
    out[2 * g] = byte_perm(lo, hi, 0x4051);      // bytes lo1, hi1, lo0, hi0
    out[2 * g + 1] = byte_perm(lo, hi, 0x6273);  // bytes lo3, hi3, lo2, hi2
  }
}

}  // namespace pykernels::nf4
