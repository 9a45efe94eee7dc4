#include "common/cpu_gemm_amx.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_memory.h"

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The tile intrinsics need GCC >= 11 or clang >= 12; an older compiler builds the extension without
// the AMX path (amx_usable() false: the AVX-512 micro-kernel runs every GEMM).
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PK_HAVE_AMX 1
#else
#define PK_HAVE_AMX 0
#endif

namespace pykernels::gemm {

#if PK_HAVE_AMX
#define PK_AMX __attribute__((target("amx-tile,amx-bf16")))

namespace {

// Tile registers: C in tmm0-3 (16 x 16 fp32 each, a 32 x 32 block of C), A in tmm4-5 (16 rows x 32
// bf16 of K), B in tmm6-7 (16 pairs of K x 16 columns: half a packed panel). Every tile is 16 rows
// of 64 bytes, so one configuration serves every call.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kTiles = 8;
constexpr int64_t kTileRows = 16;
constexpr int64_t kStepPairs = 16;                              // pairs of K per tile product
constexpr int64_t kTileElements = kTileRows * kStepPairs * 2;   // bf16 of one A tile (1 KiB)
// Cache blocks: kKPairs pairs of K by kRowBlock rows of A, packed (512 KiB: in L2 while every panel's
// B block, 64 KiB, passes over it). C is read and written once per K block, so long K blocks keep
// its traffic small. Chosen on a Sapphire Rapids core among 64-512 pairs by 128-512 rows, at the
// logprobs and MoE ops' shapes: 128 / 128 to 512 / 256 all ran 550-930 GFLOP/s, 512 / 256 best on
// the mean (the AVX-512 micro-kernel: 58-96).
constexpr int64_t kKPairs = 512;
constexpr int64_t kRowBlock = 256;

constexpr int64_t kPrefetchRows = 4;  // pack_a asks for the row this many rows on

// A[rows, 2 * pairs] (row stride lda) -> tiles: tile t of rows 16t.., K step s at (t * steps + s) *
// kTileElements, 16 rows of 64 bytes; the last tile's rows past `rows` zero. Read in place, A's rows
// are lda apart, and at K = 2048 or 4096 that is a multiple of 4 KiB: a tile's 16 rows share one L1
// set (12 ways) and evict each other; packed, each tile is 1 KiB of consecutive lines. pairs is a
// multiple of 16.
void pack_a(const uint16_t* a, int64_t lda, int64_t rows, int64_t pairs, uint16_t* out) {
  const int64_t steps = pairs / kStepPairs, padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  for (int64_t i = 0; i < padded; ++i) {
    // The run of the row kPrefetchRows on, asked for now: each row's run (2 KiB at most) starts a new
    // stream the hardware prefetchers pick up late, and the forward's A, a block of the expert's
    // weight, comes from DRAM (Mixtral's forward 0.83 -> 0.90x eager).
    if (i + kPrefetchRows < rows) {
      for (int64_t e = 0; e < 2 * pairs; e += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(a + (i + kPrefetchRows) * lda + e), _MM_HINT_T0);
      }
    }
    uint16_t* dst = out + (i / kTileRows) * steps * kTileElements + (i % kTileRows) * 2 * kStepPairs;
    for (int64_t s = 0; s < steps; ++s) {
      if (i < rows) {
        std::memcpy(dst + s * kTileElements, a + i * lda + s * 2 * kStepPairs, 2 * kStepPairs * sizeof(uint16_t));
      } else {
        std::memset(dst + s * kTileElements, 0, 2 * kStepPairs * sizeof(uint16_t));
      }
    }
  }
}

// C[R * 16, 32] (+)= A[R * 16, 2 * pairs] B (one packed panel), A packed by pack_a (a: its first
// tile; the second R tile `steps` tiles on), pairs a multiple of 16. The tile numbers are immediates
// of the instructions, hence the two spelled-out row halves.
template <int R>
PK_AMX void block(int64_t pairs, const uint16_t* a, const uint32_t* b, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t a_stride = 2 * kStepPairs * 2, b_stride = kPanel * 4;
  const int64_t c_stride = ldc * 4, steps = pairs / kStepPairs;
  float* c1 = c + kTileRows * ldc;
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    _tile_loadd(1, c + 16, c_stride);
    if constexpr (R == 2) {
      _tile_loadd(2, c1, c_stride);
      _tile_loadd(3, c1 + 16, c_stride);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (R == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const uint16_t* a1 = a + steps * kTileElements;
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* bs = b + s * kStepPairs * kPanel;
    _tile_loadd(6, bs, b_stride);
    _tile_loadd(7, bs + 16, b_stride);
    _tile_loadd(4, a + s * kTileElements, a_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (R == 2) {
      _tile_loadd(5, a1 + s * kTileElements, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_stride);
  _tile_stored(1, c + 16, c_stride);
  if constexpr (R == 2) {
    _tile_stored(2, c1, c_stride);
    _tile_stored(3, c1 + 16, c_stride);
  }
}

constexpr TileConfig make_tile_config() {
  TileConfig config;
  for (int t = 0; t < kTiles; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = kTileRows;
  }
  return config;
}

// A constant in memory, not a local: GCC 12 treated the stores of a local's unused entries (which
// ldtilecfg requires to be zero) as dead and left stack garbage there (a #GP fault).
constexpr TileConfig kTileConfig = make_tile_config();

PK_AMX void load_tile_config() { _tile_loadconfig(&kTileConfig); }

// Releases the tile state however the GEMM ends: a thread left holding it makes every context
// switch save and restore 8 KiB more.
struct TileSession {
  PK_AMX TileSession() { load_tile_config(); }
  PK_AMX ~TileSession() { _tile_release(); }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;
};

bool cpu_has_amx_bf16() {
#if defined(__linux__) && defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;  // CPUID.(7, 0):EDX
  return (edx & kAmxBf16) != 0 && (edx & kAmxTile) != 0;
#else
  return false;
#endif
}

// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux >= 5.16 hands out the tile state per
// process on request (torch does the same for oneDNN); then ARCH_GET_XCOMP_PERM confirms it.
bool os_grants_tiles() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long features = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &features) != 0) return false;
  return (features & (1ul << kXfeatureXtiledata)) != 0;
#else
  return false;
#endif
}

// block<R> with the row tile count R (1 or 2) chosen at run time.
PK_AMX void row_tiles_block(int R, int64_t pairs, const uint16_t* a, const uint32_t* b, float* c, int64_t ldc,
                            bool accumulate) {
  if (R == 2) {
    block<2>(pairs, a, b, c, ldc, accumulate);
  } else {
    block<1>(pairs, a, b, c, ldc, accumulate);
  }
}

// row_tiles_block on C's rows [0, rows) and columns [0, width) alone, through a 32 x 32 copy: the last
// row tile of A (zero rows past `rows`) and a partial last panel (B's zero columns past `width`)
// compute what C has no room for.
PK_AMX void edge_block(int R, int64_t rows, int64_t width, int64_t pairs, const uint16_t* a, const uint32_t* b,
                       float* c, int64_t ldc, bool accumulate) {
  alignas(64) float copy[2 * kTileRows * kPanel];
  if (accumulate) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(copy + r * kPanel, c + r * ldc, width * sizeof(float));
  }
  row_tiles_block(R, pairs, a, b, copy, kPanel, accumulate);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * ldc, copy + r * kPanel, width * sizeof(float));
}

// Where amx_pack_a puts the cache block of A at pairs q0.. and rows i0..: blocks in the order
// gemm_bf16_amx visits them (K blocks outer), each as pack_a writes it. Every block before it in
// its K block has kRowBlock rows, every K block before it kKPairs pairs.
int64_t packed_block_offset(int64_t m, int64_t q0, int64_t pairs, int64_t i0) {
  return 2 * q0 * ((m + kTileRows - 1) / kTileRows * kTileRows) + 2 * pairs * i0;
}

}  // namespace

bool amx_usable() {
  static const bool usable = has_bf16_gemm() && cpu_has_amx_bf16() && os_grants_tiles();
  return usable;
}

void amx_pack_a(const uint16_t* a, int64_t lda, int64_t m, int64_t k, uint16_t* dst) {
  const int64_t all_pairs = amx_pairs(k);
  for (int64_t q0 = 0; q0 < all_pairs; q0 += kKPairs) {
    const int64_t pairs = std::min(kKPairs, all_pairs - q0);
    for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
      pack_a(a + i0 * lda + 2 * q0, lda, std::min(m - i0, kRowBlock), pairs,
             dst + packed_block_offset(m, q0, pairs, i0));
    }
  }
}

void gemm_bf16_amx(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* a_packed,
                   const uint32_t* b, int64_t b_panel_stride, float* c, int64_t ldc, bool accumulate) {
  const int64_t all_pairs = amx_pairs(k);
  thread_local AlignedVector<uint16_t> packed;
  if (a_packed == nullptr) packed.resize(kRowBlock * kKPairs * 2);
  const TileSession tiles;
  for (int64_t q0 = 0; q0 < all_pairs; q0 += kKPairs) {
    const int64_t pairs = std::min(kKPairs, all_pairs - q0), steps = pairs / kStepPairs;
    const bool acc = accumulate || q0 > 0;
    for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
      const int64_t block_rows = std::min(m - i0, kRowBlock);
      const uint16_t* a_block = a_packed ? a_packed + packed_block_offset(m, q0, pairs, i0) : packed.data();
      if (a_packed == nullptr) pack_a(a + i0 * lda + 2 * q0, lda, block_rows, pairs, packed.data());
      for (int64_t p = 0; p < panels(n); ++p) {
        const uint32_t* bp = b + p * b_panel_stride + q0 * kPanel;
        const int64_t width = std::min(kPanel, n - p * kPanel);
        for (int64_t i = 0; i < block_rows; i += 2 * kTileRows) {
          const uint16_t* ai = a_block + (i / kTileRows) * steps * kTileElements;
          float* ci = c + (i0 + i) * ldc + p * kPanel;
          const int R = block_rows - i > kTileRows ? 2 : 1;
          const int64_t rows = std::min<int64_t>(R * kTileRows, block_rows - i);
          if (rows < R * kTileRows || width < kPanel) {
            edge_block(R, rows, width, pairs, ai, bp, ci, ldc, acc);
          } else {
            row_tiles_block(R, pairs, ai, bp, ci, ldc, acc);
          }
        }
      }
    }
  }
}

#else
bool amx_usable() { return false; }

void amx_pack_a(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) {}  // never called: amx_usable() is false
void gemm_bf16_amx(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, const uint32_t*, int64_t,
                   float*, int64_t, bool) {}  // never called: amx_usable() is false
#endif

}  // namespace pykernels::gemm
