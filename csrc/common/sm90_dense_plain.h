// Which CUTLASS kernel a dense GEMM of the Hopper core runs on (PYKERNELS_SM90_DENSE, read on every call):
//
//   array  the ptr-array grouped kernel with one group, as every GEMM of the core (the default)
//   plain  CUTLASS's KernelTmaWarpSpecializedCooperative for one problem (common/dense_gemm_plain_sm90.cu),
//          its TMA descriptors kernel parameters, its K over two operand pairs (extended_k_mainloop_sm90.cuh)
//
// On the H200 the LoRA forward ran 12-20% over cuBLAS's bare x W^T and ~4% over the core's own x W^T
// (benchmarks/results/h200.md): the core's GEMM, not the LoRA term, is most of the gap to issue 20's 5%. The
// plain kernel tells the ptr-array kernel's cost on one group from the core's configuration; it has not run
// on a GPU yet, so it is not the default. It takes what the LoRA forward runs and nothing else (a kernel
// costs every CI's compile check tens of seconds): rows of A times B^T (kRowsKMajorB) with extra K, one
// group, bf16 D, on the 128x256 tile; every other call stays on the array kernel. Torch- and CUDA-free:
// host-tested through pykernels._C.host_logic.
#pragma once

#include "common/grouped_gemm_sm90.h"
#include "common/two_way_choice.h"

namespace pykernels::gemm {

// Sets *plain from `setting` (null or empty: array); null on success, else a message naming the choices.
inline const char* sm90_dense_plain_for(const char* setting, bool* plain) {
  return two_way_choice(setting, "array", "plain", "PYKERNELS_SM90_DENSE must be array (the default) or plain", plain);
}

// The plain kernel takes p (asked for it or not).
inline bool sm90_plain_takes(const GroupedGemmSm90Params& p) {
  return p.expert_offsets == nullptr && p.experts == 1 && p.kind == Sm90GemmKind::kRowsKMajorB &&
         p.d_dtype == DType::kBFloat16 && p.a2 != nullptr && p.act_out == nullptr && p.a_rows == nullptr &&
         p.tile == Sm90Tile::k128x256;
}

// p runs on the plain kernel: asked for (p.plain) and taken.
inline bool sm90_runs_plain(const GroupedGemmSm90Params& p) { return p.plain && sm90_plain_takes(p); }

}  // namespace pykernels::gemm
