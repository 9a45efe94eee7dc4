// The Hopper kernels of the fused token logprobs (logprobs_sm90.cu): the lm_head GEMM with the
// softmax work in its epilogue, so the fp32 logits never reach global memory. Torch-free.
//
//   softmax partials  z = scale h W_c^T (tokens x rows, fp32 in registers); the epilogue folds
//                     each logit into per-row (max_z, sum_exp, sum_exp_z) (common/online_softmax.h,
//                     add_logit), reduces them over the threads that share a row and writes one
//                     partial per (token, 128-entry vocab tile) (vocab_chunks.h: partial_index).
//                     No D: nothing of the tile itself is stored.
//   logit grad        dz = scale (-p (g_lp + g_ent (z + shift))), p = exp(z - lse), per row
//                     lse / shift = entropy - lse / g_lp / g_ent broadcast from [tokens] vectors;
//                     dz written in bf16 (the operand of the dh and dW GEMMs that follow). The
//                     target's column (+ scale g_lp) is fixed afterwards by launch_fix_target_grads
//                     (logprobs.h): an epilogue element does not know its column.
// Both: bf16 h [tokens, H] and W_c [rows, H], row-major, H % 8 == 0, 16-byte aligned (TMA), a
// CUTLASS 3.x warp-specialized kernel (TMA loads, wgmma, the tile scheduler walking the output tiles)
// on one of two tiles, each its own file (logprobs_tile_*_sm90.cu), picked per call by
// PYKERNELS_SM90_LOGPROBS_TILE:
//   256x128           256x128x64 on a 2x1 cluster (each vocabulary tile loaded once by TMA multicast
//                     for two CTAs of tokens), cooperative (both consumer warpgroups on one tile, the
//                     epilogue after the mainloop): the default, 1.01-1.06x faster than 128x128 on an
//                     H100 (forward+backward at H 4096, V 151936, N 4096 and 16384, trainable and
//                     frozen: benchmarks/results/h100.md)
//   128x128           128x128x64 on a 1x1 cluster, cooperative
// (A 128x128 ping-pong schedule, each consumer warpgroup's epilogue under the other's wgmma, for the
// statistics epilogue's cost, ran 0.99x of 256x128 on an H200 in all four cases, h200.md: removed, with
// its ~100 s of every CI's compile check.)
// All keep 128 vocabulary entries per tile (a partial per (token, 128 entries) whatever the tile).
// Built only when the archs include sm_90a (cmake/sm90_sources.cmake); the GEMM core's
// grouped_gemm_sm90_available says where they run.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/tails.h"
#include "common/two_way_choice.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::logprobs {

// The default first: a value-initialized LogitsGemmSm90 runs it.
enum class LogprobsSm90Tile { k256x128, k128x128 };
constexpr LogprobsSm90Tile kLogprobsSm90Tiles[] = {LogprobsSm90Tile::k256x128, LogprobsSm90Tile::k128x128};

inline const char* logprobs_sm90_tile_name(LogprobsSm90Tile tile) {
  switch (tile) {
    case LogprobsSm90Tile::k256x128: return "256x128";
    case LogprobsSm90Tile::k128x128: return "128x128";
  }
  return "256x128";
}

// The tile PYKERNELS_SM90_LOGPROBS_TILE (`setting`; null or empty: the default) names. Null on
// success, else a message naming the choices.
inline const char* logprobs_sm90_tile_for(const char* setting, LogprobsSm90Tile* tile) {
  *tile = LogprobsSm90Tile::k256x128;
  if (setting == nullptr || setting[0] == '\0') return nullptr;
  for (const LogprobsSm90Tile candidate : kLogprobsSm90Tiles) {
    if (std::strcmp(setting, logprobs_sm90_tile_name(candidate)) == 0) {
      *tile = candidate;
      return nullptr;
    }
  }
  return "PYKERNELS_SM90_LOGPROBS_TILE must be 256x128 (the default) or 128x128";
}

// PYKERNELS_SM90_LOGPROBS_FOLD picks how the statistics epilogue folds a row's logits (`setting`; null
// or empty: the default; common/online_softmax.h, add_logit):
//   running_max  each partial relative to the row's running max, re-based at every new max: the
//                measured default
//   lazy_max     relative to a reference that moves only when a logit passes it by kLazyMaxSlack:
//                the same sums (up to rounding) without the new-max re-bases that split a warp's
//                lanes across two paths. Not yet timed
// Sets *lazy; null on success, else a message naming the choices. Read on every call.
inline const char* logprobs_sm90_lazy_fold_for(const char* setting, bool* lazy) {
  return two_way_choice(setting, "running_max", "lazy_max",
                        "PYKERNELS_SM90_LOGPROBS_FOLD must be running_max (the default) or lazy_max", lazy);
}

// The logits GEMM both kernels share: z [tokens, rows] = scale hidden W^T.
struct LogitsGemmSm90 {
  const void* hidden;  // bf16 [tokens, h], row stride h
  const void* weight;  // bf16 [rows, h], row stride h
  int64_t tokens, rows, h;
  float scale;         // 1 / temperature
  LogprobsSm90Tile tile;
};

struct SoftmaxPartialsSm90Params {
  LogitsGemmSm90 gemm;
  float* max_z;  // each [vocab_tiles(rows)][partial_rows(tokens)]; max_z the partial's reference
  float* sum_exp;
  float* sum_exp_z;
  float slack;  // add_logit's (common/online_softmax.h): 0, or kLazyMaxSlack under lazy_max
};

struct LogitGradSm90Params {
  LogitsGemmSm90 gemm;
  const float* lse;  // each [tokens]
  const float* shift;  // entropy - lse
  const float* grad_logprob;
  const float* grad_entropy;
  void* dz;  // bf16 [tokens, ld]
  int64_t ld;
};

// What TMA and the 32-bit problem shapes need, or null (host-tested through pykernels._C.host_logic).
inline const char* logits_gemm_sm90_error(const LogitsGemmSm90& g) {
  constexpr int64_t kMax = int64_t{1} << 31;
  if (g.tokens < 1 || g.rows < 1 || g.h < 1 || g.tokens >= kMax || g.rows >= kMax || g.h >= kMax)
    return "tokens, rows and hidden size must lie in [1, 2^31)";
  if (g.h % 8 != 0) return "the hidden size must be a multiple of 8 (16-byte rows for TMA)";
  if (!is_aligned(g.hidden, 16) || !is_aligned(g.weight, 16)) return "hidden and weight must be 16-byte aligned";
  return nullptr;
}

inline const char* logit_grad_sm90_error(const LogitGradSm90Params& p) {
  if (const char* error = logits_gemm_sm90_error(p.gemm)) return error;
  if (p.ld < p.gemm.rows || p.ld % 8 != 0) return "dz's row stride must cover the rows and be a multiple of 8";
  if (!is_aligned(p.dz, 16)) return "dz must be 16-byte aligned";
  return nullptr;
}

bool logprobs_sm90_built();  // compiled for sm_90a into this build
int64_t softmax_partials_sm90_workspace_bytes(const SoftmaxPartialsSm90Params& p, int device);
int64_t logit_grad_sm90_workspace_bytes(const LogitGradSm90Params& p, int device);
// nullptr on success, else a message.
const char* launch_softmax_partials_sm90(const SoftmaxPartialsSm90Params& p, void* workspace, int device,
                                         cudaStream_t stream);
const char* launch_logit_grad_sm90(const LogitGradSm90Params& p, void* workspace, int device, cudaStream_t stream);

}  // namespace pykernels::logprobs
