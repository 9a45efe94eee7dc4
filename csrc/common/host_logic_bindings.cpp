// pykernels._C.host_logic: the __host__ __device__ index/tile arithmetic of the CUDA kernels
// (common/tails.h, common/online_softmax.h, nf4/nf4_layout.h, moe/moe_schedule.h,
// common/gemm_groups.h, common/gemm_sm90_dense.h, common/sm90_dense_plain.h, logprobs/vocab_chunks.h,
// logprobs/logit_grad.h, logprobs/logprobs_sm90.h, lora/lora.h's split-k plan, nf4/nf4_decode_bf16.h,
// nf4/nf4_gemm_sm90.h),
// compiled for the host and exposed with plain ints, floats and lists so that
// tests/kernels/test_device_logic_host.py (and the family tests beside it) check it against direct
// Python / fp64 computations on a machine without a GPU. Test-only: no op, no torch tensor; where a
// kernel composes the helpers (the row-tile schedule, the routing maps, a dequantize pass) the
// function here composes them in the same way, serially.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/gemm_groups.h"
#include "common/gemm_sm90_dense.h"
#include "common/grouped_gemm_sm90.h"
#include "common/online_softmax.h"
#include "common/sm90_dense_plain.h"
#include "common/tails.h"
#include "logprobs/logit_grad.h"
#include "lora/lora.h"
#include "lora/lora_extended_k.h"
#include "lora/lora_rank_pieces.h"
#include "lora/nf4_chunks.h"
#include "logprobs/logprobs_sm90.h"
#include "logprobs/vocab_chunks.h"
#include "moe/moe.h"
#include "moe/moe_schedule.h"
#include "nf4/nf4.h"
#include "nf4/nf4_decode_bf16.h"
#include "nf4/nf4_gemm_sm90.h"
#include "nf4/nf4_layout.h"

namespace py = pybind11;

namespace pykernels {
namespace {

using Partial = std::tuple<float, float, float>;  // (max_z, sum_exp, sum_exp_z)

SoftmaxPartial to_partial(const Partial& p) { return {std::get<0>(p), std::get<1>(p), std::get<2>(p)}; }
Partial from_partial(const SoftmaxPartial& p) { return {p.max_z, p.sum_exp, p.sum_exp_z}; }

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

// ------------------------------------------------------------------ Hopper GEMM core: parameters
// Stand-in operand addresses: 16-byte aligned, or 2 bytes off for `misaligned`.
const void* fake_address(int64_t slot, bool misaligned) {
  return reinterpret_cast<const void*>(uintptr_t(0x10000) * (slot + 1) + (misaligned ? 2 : 0));
}

DType dtype_named(const std::string& name) {
  require(name == "bf16" || name == "fp32" || name == "fp16", "dtype must be 'bf16', 'fp16' or 'fp32'");
  return name == "bf16" ? DType::kBFloat16 : name == "fp16" ? DType::kFloat16 : DType::kFloat32;
}

const char* kind_name(gemm::Sm90GemmKind kind) {
  switch (kind) {
    case gemm::Sm90GemmKind::kRowsKMajorB: return "rows_k_major_b";
    case gemm::Sm90GemmKind::kRowsNMajorB: return "rows_n_major_b";
    default: return "weight_grad";
  }
}

// A gemm::GemmParams as the LoRA and logprobs ops fill it (C aliases D when accumulate), through
// dense_gemm_as_group: None when the core does not take it, else (kind, slots, m, n, k, the
// launcher's parameter check: None or its message).
py::object gemm_sm90_dense(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldd,
                           bool a_transposed, bool b_transposed, const std::string& ab_dtype,
                           const std::string& d_dtype, bool accumulate, bool misaligned) {
  gemm::GemmParams p{};
  p.m = m, p.n = n, p.k = k;
  p.a = fake_address(0, misaligned), p.lda = lda, p.a_transposed = a_transposed;
  p.b = fake_address(1, false), p.ldb = ldb, p.b_transposed = b_transposed;
  p.d = const_cast<void*>(fake_address(2, false)), p.ldd = ldd;
  p.c = accumulate ? p.d : nullptr, p.ldc = ldd;
  p.ab_dtype = dtype_named(ab_dtype), p.d_dtype = dtype_named(d_dtype);
  p.alpha = 1.0f, p.beta = accumulate ? 1.0f : 0.0f;
  gemm::GroupedGemmSm90Params g{};
  if (!gemm::dense_gemm_as_group(p, g)) return py::none();
  const char* error = gemm::grouped_gemm_sm90_error(g);
  return py::make_tuple(kind_name(g.kind), g.slots, g.m, g.n, g.k,
                        error ? py::object(py::str(error)) : py::object(py::none()));
}

// common/sm90_dense_plain.h: whether the plain kernel takes a 256 x 256 x 256 GEMM of the LoRA and logprobs
// ops (through dense_gemm_as_group) run on `tile`, with extra K, as a grouped (MoE) call, gated or gathered.
bool gemm_sm90_plain_takes(bool a_transposed, bool b_transposed, const std::string& d_dtype, const std::string& tile,
                           bool extra_k, bool grouped, bool gated, bool gathered) {
  static const int64_t offsets[3] = {0, 128, 256};
  gemm::GemmParams p{};
  p.m = p.n = p.k = p.lda = p.ldb = p.ldd = p.ldc = 256;
  p.a = fake_address(0, false), p.b = fake_address(1, false), p.d = const_cast<void*>(fake_address(2, false));
  p.a_transposed = a_transposed, p.b_transposed = b_transposed;
  p.ab_dtype = DType::kBFloat16, p.d_dtype = dtype_named(d_dtype), p.alpha = 1.0f;
  gemm::GroupedGemmSm90Params g{};
  if (!gemm::dense_gemm_as_group(p, g)) return false;
  bool named = false;
  for (const gemm::Sm90Tile candidate : gemm::kSm90Tiles) {
    if (tile == gemm::sm90_tile_name(candidate)) g.tile = candidate, named = true;
  }
  require(named, "tile must be one of gemm_sm90_tiles");
  if (extra_k) g.a2 = fake_address(3, false), g.b2 = fake_address(4, false), g.k2 = 64;
  if (grouped) g.expert_offsets = offsets, g.experts = 2;
  if (gated) g.act_out = const_cast<void*>(fake_address(5, false));
  if (gathered) g.a_rows = offsets;
  return gemm::sm90_plain_takes(g);
}

// The launcher's parameter check on a grouped call (MoE: expert_offsets given) or a dense one.
py::object gemm_sm90_error(const std::string& kind, bool grouped, int64_t experts, int64_t slots, int64_t m,
                           int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t b_expert_stride, int64_t ldd,
                           int64_t d_expert_stride, const std::string& d_dtype, bool accumulate, bool zeros) {
  static const int64_t offsets[2] = {0, 0};  // only its presence matters to the check
  gemm::GroupedGemmSm90Params g{};
  g.kind = kind == "weight_grad"      ? gemm::Sm90GemmKind::kWeightGrad
           : kind == "rows_n_major_b" ? gemm::Sm90GemmKind::kRowsNMajorB
                                      : gemm::Sm90GemmKind::kRowsKMajorB;
  g.slots = slots, g.experts = experts, g.expert_offsets = grouped ? offsets : nullptr;
  g.m = m, g.n = n, g.k = k;
  g.a = fake_address(0, false), g.lda = lda, g.b = fake_address(1, false), g.ldb = ldb;
  g.b_expert_stride = b_expert_stride;
  g.d = const_cast<void*>(fake_address(2, false)), g.ldd = ldd, g.d_expert_stride = d_expert_stride;
  g.c = accumulate ? g.d : nullptr;
  g.d_dtype = dtype_named(d_dtype);
  g.alpha = 1.0f, g.beta = accumulate ? 1.0f : 0.0f;
  g.zeros = zeros ? fake_address(3, false) : nullptr;
  const char* error = gemm::grouped_gemm_sm90_error(g);
  return error ? py::object(py::str(error)) : py::object(py::none());
}

// The check on a grouped rows GEMM with extra K (the MoE experts' LoRA, grouped_gemm_sm90.h).
// grouped false: the dense LoRA forward's one group (no expert_offsets); ldd 0: n.
py::object gemm_sm90_extra_k_error(const std::string& kind, int64_t n, int64_t k, int64_t k2, int64_t lda2,
                                   int64_t ldb2, int64_t b2_expert_stride, const std::string& d_dtype,
                                   bool misaligned, bool grouped, int64_t ldd) {
  static const int64_t offsets[2] = {0, 0};
  gemm::GroupedGemmSm90Params g{};
  g.kind = kind == "rows_n_major_b" ? gemm::Sm90GemmKind::kRowsNMajorB : gemm::Sm90GemmKind::kRowsKMajorB;
  g.slots = 64, g.experts = 1, g.expert_offsets = grouped ? offsets : nullptr, g.n = n, g.k = k;
  g.a = fake_address(0, false), g.lda = k, g.b = fake_address(1, false);
  g.ldb = g.kind == gemm::Sm90GemmKind::kRowsNMajorB ? n : k;
  g.b_expert_stride = n * k, g.d = const_cast<void*>(fake_address(2, false)), g.ldd = ldd > 0 ? ldd : n;
  g.d_dtype = dtype_named(d_dtype), g.alpha = 1.0f;
  g.a2 = fake_address(3, misaligned), g.lda2 = lda2, g.k2 = k2;
  g.b2 = fake_address(4, false), g.ldb2 = ldb2, g.b2_expert_stride = b2_expert_stride;
  const char* error = gemm::grouped_gemm_sm90_error(g);
  return error ? py::object(py::str(error)) : py::object(py::none());
}

// The check on the gated gate_up GEMM (grouped_gemm_sm90.h, common/paired_rows.h): a grouped rows
// GEMM of n = 2I columns on `tile`, with or without extra K.
py::object gemm_sm90_gated_error(const std::string& kind, int64_t n, int64_t k, const std::string& tile,
                                 const std::string& d_dtype, bool accumulate, int64_t k2) {
  static const int64_t offsets[2] = {0, 0};
  gemm::GroupedGemmSm90Params g{};
  g.kind = kind == "rows_n_major_b" ? gemm::Sm90GemmKind::kRowsNMajorB : gemm::Sm90GemmKind::kRowsKMajorB;
  g.slots = 64, g.experts = 1, g.expert_offsets = offsets, g.n = n, g.k = k;
  g.a = fake_address(0, false), g.lda = k, g.b = fake_address(1, false), g.ldb = k, g.b_expert_stride = n * k;
  g.d = const_cast<void*>(fake_address(2, false)), g.ldd = n, g.d_dtype = dtype_named(d_dtype), g.alpha = 1.0f;
  g.c = accumulate ? g.d : nullptr, g.beta = accumulate ? 1.0f : 0.0f;
  if (const char* error = gemm::sm90_tile_for(tile.c_str(), 64, n, &g.tile)) return py::str(error);
  if (k2 > 0) g.a2 = fake_address(3, false), g.lda2 = k2, g.k2 = k2, g.b2 = fake_address(4, false), g.ldb2 = k2;
  g.b2_expert_stride = n * k2;
  g.act_out = const_cast<void*>(fake_address(5, false));
  const char* error = gemm::grouped_gemm_sm90_error(g);
  return error ? py::object(py::str(error)) : py::object(py::none());
}

// common/paired_rows.h on one tile: for each of its cluster_m parts, the box at (n_tile, part) read
// through the descriptor's geometry, element by element: (the tile's row it lands in, the weight's row
// it reads), as the TMA unit would place and fetch them.
std::vector<std::pair<int64_t, int64_t>> gemm_paired_rows_tile(int64_t inner, int64_t k, int64_t ldb,
                                                               int64_t block_n, int64_t cluster_m, int64_t n_tile) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  const gemm::PairedRowsBox box = gemm::paired_rows_box(inner, k, ldb, 2, block_n, gemm::kSm90TileK, cluster_m);
  for (int64_t part = 0; part < cluster_m; ++part) {
    const int64_t j0 = gemm::paired_rows_j0(n_tile, part, block_n, cluster_m);
    const int64_t first = gemm::paired_rows_first_tile_row(part, block_n, cluster_m);
    for (uint32_t jj = 0; jj < box.box[2]; ++jj) {
      for (uint32_t h = 0; h < box.box[1]; ++h) {  // dims fastest first: (k, half, j), smem rows h + 2 jj
        const uint64_t bytes = h * box.strides[0] + (uint64_t(j0) + jj) * box.strides[1];
        rows.emplace_back(first + h + 2 * int64_t(jj), int64_t(bytes / box.strides[1]));  // in rows of ldb
      }
    }
  }
  return rows;
}

// common/gemm_groups.h: (a2_offset, b2_offset, k) of each group of a rows GEMM with extra K.
std::vector<std::tuple<int64_t, int64_t, int64_t>> gemm_sm90_extra_k_groups(const std::vector<int64_t>& offsets,
                                                                            int64_t slots, int64_t k, int64_t k2,
                                                                            int64_t lda2, int64_t b2_expert_stride,
                                                                            int64_t block_k) {
  require(offsets.size() >= 2 && slots >= 0 && block_k >= 1, "need experts + 1 >= 2 offsets and block_k >= 1");
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<std::tuple<int64_t, int64_t, int64_t>> groups;
  for (int64_t e = 0; e < experts; ++e) {
    const gemm::ExtraKGroup x =
        gemm::extra_k_group(offsets.data(), experts, slots, e, k, k2, lda2, b2_expert_stride, block_k);
    groups.emplace_back(x.a2_offset, x.b2_offset, x.k);
  }
  return groups;
}

// common/sm90_tiles.h through grouped_gemm_sm90.h: the tile a GEMM of this kind and sizes runs on when
// PYKERNELS_SM90_TILE is `setting` (None: unset), or the error message.
std::string gemm_sm90_tile(const std::optional<std::string>& setting, const std::string& kind, int64_t experts,
                           int64_t slots, int64_t m, int64_t n) {
  gemm::GroupedGemmSm90Params g{};
  g.kind = kind == "weight_grad" ? gemm::Sm90GemmKind::kWeightGrad : gemm::Sm90GemmKind::kRowsKMajorB;
  g.experts = experts, g.slots = slots, g.m = m, g.n = n;
  const char* error = gemm::sm90_tile_for(setting ? setting->c_str() : nullptr, gemm::mean_group_rows(g), g.n, &g.tile);
  require(error == nullptr, error ? error : "");
  return gemm::sm90_tile_name(g.tile);
}

// ------------------------------------------------------------------ MoE
// The sm_90a grouped GEMM's problem list, as group_setup_kernel writes it (one entry per group):
// (m, n, k, a_offset, b_offset, d_offset, zeros). kind "rows" or "weight_grad"; offsets None: a
// dense GEMM, one group of all slots.
using GroupTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool>;
std::vector<GroupTuple> gemm_sm90_groups(const std::string& kind, const std::optional<std::vector<int64_t>>& offsets,
                                         int64_t slots,
                                        int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                                        int64_t b_expert_stride, int64_t ldd, int64_t d_expert_stride) {
  require((!offsets || offsets->size() >= 2) && slots >= 0, "need experts + 1 >= 2 offsets (or None) and slots >= 0");
  require(kind == "rows" || kind == "weight_grad", "kind must be 'rows' or 'weight_grad'");
  const int64_t experts = offsets ? static_cast<int64_t>(offsets->size()) - 1 : 1;
  const int64_t* data = offsets ? offsets->data() : nullptr;
  std::vector<GroupTuple> groups;
  for (int64_t e = 0; e < experts; ++e) {
    const gemm::GroupProblem g =
        kind == "rows" ? gemm::rows_group(data, experts, slots, e, n, k, lda, b_expert_stride, ldd)
                       : gemm::weight_grad_group(data, experts, slots, e, m, n, lda, ldb, d_expert_stride);
    groups.emplace_back(g.m, g.n, g.k, g.a_offset, g.b_offset, g.d_offset, g.zeros);
  }
  return groups;
}

// (bucket, first slot, end slot) per CTA row of the grid, (-1, 0, 0) for CTAs with no tile: the
// tile_schedule_kernel's scan done serially, then row_tile_start / row_tile_end per CTA as the
// kernels call them.
std::vector<std::tuple<int64_t, int64_t, int64_t>> moe_row_tile_schedule(const std::vector<int64_t>& offsets,
                                                                       int64_t slots, int64_t rows_per_tile) {
  require(!offsets.empty() && rows_per_tile >= 1 && slots >= 0, "need experts + 1 offsets and rows_per_tile >= 1");
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int64_t> tile_start(experts + 1);
  int64_t total = 0;
  for (int64_t b = 0; b <= experts; ++b) {
    const int64_t count = moe::bucket_row_tiles(moe::bucket_slots(offsets.data(), experts, slots, b), rows_per_tile);
    tile_start[b] = total;
    total += count;
  }
  const int64_t grid = moe::max_row_tiles(slots, experts, rows_per_tile);
  std::vector<std::tuple<int64_t, int64_t, int64_t>> tiles;
  tiles.reserve(grid);
  for (int64_t t = 0; t < grid; ++t) {
    if (t >= total) {
      tiles.emplace_back(-1, 0, 0);
      continue;
    }
    const moe::RowTileStart start =
        moe::row_tile_start(offsets.data(), experts, slots, tile_start.data(), rows_per_tile, t);
    const moe::SlotRange bucket = moe::bucket_slots(offsets.data(), experts, slots, start.bucket);
    tiles.emplace_back(start.bucket, start.first, moe::row_tile_end(start.first, rows_per_tile, bucket));
  }
  return tiles;
}

std::vector<std::pair<int64_t, int64_t>> moe_bucket_slots(const std::vector<int64_t>& offsets, int64_t slots) {
  require(!offsets.empty(), "need experts + 1 >= 1 offsets");
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t b = 0; b <= experts; ++b) {
    const moe::SlotRange r = moe::bucket_slots(offsets.data(), experts, slots, b);
    ranges.emplace_back(r.begin, r.end);
  }
  return ranges;
}

// (token_of_slot, k_slot_of_slot, slot_of_assignment) as routing_maps_kernel writes them;
// slot_of_assignment entries no slot writes stay -2.
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> moe_routing_maps(
    const std::vector<int64_t>& sorted_token_idx, const std::vector<int64_t>& offsets, int64_t top_k) {
  require(!offsets.empty() && top_k >= 1, "need experts + 1 >= 1 offsets and top_k >= 1");
  const int64_t slots = static_cast<int64_t>(sorted_token_idx.size());
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t valid_end = moe::bucket_slots(offsets.data(), experts, slots, experts).begin;
  std::vector<int64_t> token_of_slot(slots), k_slot_of_slot(slots), slot_of_assignment(slots, -2);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t a = sorted_token_idx[s];
    const moe::AssignmentSource source = moe::assignment_source(a, slots, top_k);
    token_of_slot[s] = source.token;
    k_slot_of_slot[s] = source.k_slot;
    if (source.token >= 0) slot_of_assignment[a] = moe::kept_slot(s, valid_end);
  }
  return {token_of_slot, k_slot_of_slot, slot_of_assignment};
}

int64_t moe_slot_row_index(const std::optional<std::vector<int64_t>>& map, int64_t s, int64_t rows) {
  require(!map || (s >= 0 && s < static_cast<int64_t>(map->size())), "s must index map");
  return moe::slot_row_index(map ? map->data() : nullptr, s, rows);
}

// ------------------------------------------------------------------ NF4
// Codes of elements [0, numel) of `packed`, read as the dequantize kernel reads them.
std::vector<int> nf4_unpack_codes(const std::vector<uint8_t>& packed, int64_t numel) {
  require(static_cast<int64_t>(packed.size()) >= nf4::packed_bytes(numel), "packed is shorter than (numel + 1) / 2");
  std::vector<int> codes(numel);
  for (int64_t i = 0; i < numel; ++i) codes[i] = nf4::code_of_element(packed[nf4::packed_byte_of(i)], i);
  return codes;
}

// The quantize kernel's 32-bit word of 8 codes.
uint32_t nf4_pack_word(const std::vector<uint32_t>& codes) {
  require(codes.size() == 8, "need 8 codes");
  uint32_t word = 0;
  for (int i = 0; i < 8; ++i) word |= codes[i] << nf4::packed_word_shift(i);
  return word;
}

// i / by.d as a dequantize kernel computes it: by a shift in its shift variant, else by a division.
int64_t nf4_kernel_divide(const nf4::Divider& by, int64_t i, bool shift) {
  return shift ? nf4::divide_as<true>(by, i) : nf4::divide_as<false>(by, i);
}

// Dequantize of a double-quantized NF4 tensor composed as dequantize_kernel composes the helpers
// (block and nested block by the variant its launcher picks, block scale decoded per block, one
// product per value).
std::vector<float> nf4_dequantize_double_quant(const std::vector<uint8_t>& packed, int64_t numel, int64_t blocksize,
                                               const std::vector<uint8_t>& absmax_q,
                                               const std::vector<float>& nested_code,
                                               const std::vector<float>& nested_absmax, float nested_offset,
                                               int64_t nested_blocksize) {
  require(blocksize >= 1 && nested_blocksize >= 1 && nested_code.size() == 256, "bad blocksize or nested_code");
  require(static_cast<int64_t>(absmax_q.size()) >= nf4::num_blocks(numel, blocksize), "absmax_q too short");
  const nf4::Divider block_div = nf4::divider(blocksize), nested_div = nf4::divider(nested_blocksize);
  const bool shift = nf4::dequantize_by_shifts(block_div, nested_div, /*double_quant=*/true);
  std::vector<float> out(numel);
  for (int64_t i = 0; i < numel; ++i) {
    const int64_t block = nf4_kernel_divide(block_div, i, shift);
    const int64_t nested = nf4_kernel_divide(nested_div, block, shift);
    require(nested < static_cast<int64_t>(nested_absmax.size()), "nested_absmax too short");
    const float scale = nf4::decode_absmax(nested_code[absmax_q[block]], nested_absmax[nested], nested_offset);
    out[i] = nf4::dequantize_value(nf4::kCode[nf4::code_of_element(packed.at(nf4::packed_byte_of(i)), i)], scale);
  }
  return out;
}

// The warp-chunk dequantize (nf4.cu's dequantize_warps_kernel, PYKERNELS_NF4_DEQUANT=warps) composed
// on the host from the layout helpers it uses (nf4_layout.h): per whole chunk of kWarpChunkValues, the
// 512 staged bytes in lane order, lane l's scale of block (c0 >> shift) + l, and lane t's store units,
// each decoded with the scale of lane warp_scale_lane; the last, partial chunk value by value. Every
// value must be written exactly once and every scale taken from a lane that holds one. unit_values:
// 8 (16-bit out) or 4 (fp32); absmax per block (the scale decode is the units kernel's).
std::vector<float> nf4_dequantize_warps(const std::vector<uint8_t>& packed, int64_t numel, int64_t blocksize,
                                        const std::vector<float>& absmax, int unit_values) {
  const nf4::Divider block_div = nf4::divider(blocksize);
  require(block_div.shift >= 5, "the warp kernel runs for power-of-two blocksizes >= 32");
  require(unit_values == 8 || unit_values == 4, "unit_values is 8 (16-bit out) or 4 (fp32)");
  require(static_cast<int64_t>(packed.size()) >= nf4::packed_bytes(numel), "packed too short");
  require(static_cast<int64_t>(absmax.size()) >= nf4::num_blocks(numel, blocksize), "absmax too short");
  const int shift = block_div.shift;
  const int units_per_lane = static_cast<int>(nf4::kWarpChunkValues) / (32 * unit_values);
  std::vector<float> out(numel, 0.0f);
  std::vector<int> writes(numel, 0);
  auto write = [&](int64_t i, int code, float scale) {
    out[i] = nf4::dequantize_value(nf4::kCode[code], scale);
    ++writes[i];
  };
  for (int64_t c0 = 0; c0 < numel; c0 += nf4::kWarpChunkValues) {
    if (c0 + nf4::kWarpChunkValues > numel) {
      for (int64_t i = c0; i < numel; ++i)
        write(i, nf4::code_of_element(packed[nf4::packed_byte_of(i)], i), absmax[i >> shift]);
      continue;
    }
    const uint8_t* staged = packed.data() + nf4::packed_byte_of(c0);  // 32 lanes x 16 bytes, in lane order
    float lane_scale[32];
    for (int lane = 0; lane < 32; ++lane)
      lane_scale[lane] = nf4::warp_lane_has_scale(c0, lane, shift) ? absmax[(c0 >> shift) + lane] : 0.0f;
    for (int lane = 0; lane < 32; ++lane) {
      for (int u = 0; u < units_per_lane; ++u) {
        const int64_t offset = nf4::warp_unit_offset(u, lane, unit_values);
        const int source = nf4::warp_scale_lane(c0, offset, shift);
        require(source >= 0 && source < 32 && nf4::warp_lane_has_scale(c0, source, shift),
                "a unit's scale from a lane that holds none");
        require((source + (c0 >> shift)) == ((c0 + offset + unit_values - 1) >> shift), "a unit spans two blocks");
        for (int k = 0; k < unit_values / 2; ++k) {
          const uint8_t byte = staged[nf4::packed_byte_of(offset) + k];
          write(c0 + offset + 2 * k, nf4::high_code(byte), lane_scale[source]);
          write(c0 + offset + 2 * k + 1, nf4::low_code(byte), lane_scale[source]);
        }
      }
    }
  }
  for (int64_t i = 0; i < numel; ++i) require(writes[i] == 1, "a value written other than once");
  return out;
}

// ------------------------------------------------------------------ logprobs
std::vector<std::pair<int64_t, int64_t>> logprobs_chunks(int64_t extent, int64_t chunk) {
  require(extent >= 0 && chunk >= 1, "need extent >= 0 and chunk >= 1");
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t i = 0; i < logprobs::chunk_count(extent, chunk); ++i) {
    const logprobs::Chunk c = logprobs::chunk_at(extent, chunk, i);
    chunks.emplace_back(c.begin, c.size);
  }
  return chunks;
}

// Per target: (how many vocab chunks claim it, v0 + column of the last claim or -1), walking the
// chunks as the CUDA op does and asking target_column of each, as the fold and grad kernels do.
std::vector<std::pair<int64_t, int64_t>> logprobs_target_claims(const std::vector<int64_t>& targets, int64_t vocab,
                                                                int64_t chunk) {
  require(vocab >= 0 && chunk >= 1, "need vocab >= 0 and chunk >= 1");
  std::vector<std::pair<int64_t, int64_t>> claims;
  for (const int64_t target : targets) {
    int64_t count = 0, where = -1;
    for (int64_t i = 0; i < logprobs::chunk_count(vocab, chunk); ++i) {
      const logprobs::Chunk c = logprobs::chunk_at(vocab, chunk, i);
      const int64_t column = logprobs::target_column(target, c.begin, c.size);
      if (column >= 0) {
        ++count;
        where = c.begin + column;
      }
    }
    claims.emplace_back(count, where);
  }
  return claims;
}

// Partials (max, sum_exp, sum_exp_z relative to their own max) merged in order into stats
// initialised as the CUDA op initialises them: (-inf, 0, 0).
Partial softmax_merge_all(const std::vector<Partial>& chunks) {
  SoftmaxPartial running{-INFINITY, 0.0f, 0.0f};
  for (const Partial& c : chunks) running = merge_partials(running, to_partial(c));
  return from_partial(running);
}

Partial softmax_add_logits(const std::vector<float>& logits, float slack) {
  SoftmaxPartial running{-INFINITY, 0.0f, 0.0f};
  for (const float z : logits) running = add_logit(running, z, slack);
  return from_partial(running);
}

// The Hopper forward's statistics for logits z [tokens][cols] (one vocab chunk), as its kernels
// make them: per (row, 128-column tile) the four lanes of a wgmma quad each fold their column pairs
// with add_logit at `slack` (columns past cols skipped), the shuffle tree merges lane 2 into 0 and 3 into 1,
// then 1 into 0; the partial goes to the planes at partial_index; the fold pass merges a row's
// partials in tile order into stats that start empty. Returns (lse, entropy) per row.
std::vector<std::pair<float, float>> logprobs_sm90_stats(const std::vector<std::vector<float>>& z, float slack) {
  const int64_t tokens = static_cast<int64_t>(z.size());
  require(tokens >= 1, "need at least one row");
  const int64_t cols = static_cast<int64_t>(z[0].size());
  for (const auto& row : z) require(static_cast<int64_t>(row.size()) == cols && cols >= 1, "rows of one length >= 1");
  const int64_t tiles = logprobs::vocab_tiles(cols), rows_padded = logprobs::partial_rows(tokens);
  std::vector<SoftmaxPartial> planes(static_cast<size_t>(tiles * rows_padded), {NAN, NAN, NAN});  // garbage
  for (int64_t row = 0; row < rows_padded; ++row) {  // the padding rows' lanes run too (no logits)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      SoftmaxPartial lane[4];
      for (int l = 0; l < 4; ++l) {
        lane[l] = {-INFINITY, 0.0f, 0.0f};
        for (int64_t c = tile * logprobs::kSm90Tile + 2 * l; c < (tile + 1) * logprobs::kSm90Tile; c += 8) {
          for (int64_t pair = c; pair < c + 2; ++pair)
            if (row < tokens && pair < cols) lane[l] = add_logit(lane[l], z[row][pair], slack);
        }
      }
      lane[0] = merge_partials(lane[0], lane[2]);
      lane[1] = merge_partials(lane[1], lane[3]);
      planes[logprobs::partial_index(row, tile, rows_padded)] = merge_partials(lane[0], lane[1]);
    }
  }
  std::vector<std::pair<float, float>> out;
  for (int64_t row = 0; row < tokens; ++row) {
    SoftmaxPartial running{-INFINITY, 0.0f, 0.0f};
    for (int64_t tile = 0; tile < tiles; ++tile)
      running = merge_partials(running, planes[logprobs::partial_index(row, tile, rows_padded)]);
    const SoftmaxSummary summary = summarize_partial(running);
    out.emplace_back(summary.lse, summary.entropy);
  }
  return out;
}

const char* logprobs_sm90_error(int64_t tokens, int64_t rows, int64_t h, uintptr_t hidden, uintptr_t weight,
                                int64_t ld, uintptr_t dz) {
  logprobs::LogitGradSm90Params p{};
  p.gemm = {reinterpret_cast<const void*>(hidden), reinterpret_cast<const void*>(weight), tokens, rows, h, 1.0f,
            logprobs::LogprobsSm90Tile::k128x128};
  p.dz = reinterpret_cast<void*>(dz);
  p.ld = ld;
  return ld == 0 ? logprobs::logits_gemm_sm90_error(p.gemm) : logprobs::logit_grad_sm90_error(p);
}

// lora/nf4_chunks.h: rows per dequantized chunk of an NF4 weight under PYKERNELS_NF4_CHUNK_MIB=`setting`.
int64_t lora_nf4_chunk_rows(int64_t n, int64_t k, int64_t m, int64_t element_size, int64_t sms,
                            const std::optional<std::string>& setting) {
  int64_t cap_bytes = 0;
  const char* error = lora::nf4_chunk_cap_for(setting ? setting->c_str() : nullptr, &cap_bytes);
  require(error == nullptr, error ? error : "");
  return lora::nf4_chunk_rows(n, k, m, element_size, sms, cap_bytes);
}

// lora/lora.h: the rank GEMM's tile and split-k plan, and the workspace the binding allocates.
std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> lora_rank_gemm_plan(int64_t m, int64_t n, int64_t k,
                                                                           int sms) {
  const lora::RankTile tile = lora::rank_tile(m, n);
  const lora::RankSplit split = lora::rank_gemm_split(m, n, k, sms);
  lora::RankGemmParams p{};
  p.m = m, p.n = n, p.k = k, p.sms = sms;
  return {tile.m, tile.n, split.splits, split.k_per_split, lora::rank_gemm_workspace_floats(p)};
}

// lora/lora_extended_k.h: U [m, width] and V [n, width] (row lists of floats, each a bf16 value)
// built element by element as the packing kernel does, from xa [m][r], b [n][r] (fp32 values; as
// bf16 when b_is_fp32 is false) and bias [n] or empty.
using Matrix = std::vector<std::vector<float>>;
std::tuple<int64_t, int64_t, Matrix, Matrix> lora_extended_k_operands(const Matrix& xa, const Matrix& b,
                                                                       const std::vector<float>& bias, float scaling,
                                                                       bool b_is_fp32) {
  require(!xa.empty() && !b.empty() && !xa[0].empty(), "xa and b need rows and r >= 1");
  const int64_t r = static_cast<int64_t>(xa[0].size());
  for (const auto& row : xa) require(static_cast<int64_t>(row.size()) == r, "xa's rows must all have r values");
  for (const auto& row : b) require(static_cast<int64_t>(row.size()) == r, "b's rows must have r values like xa's");
  require(bias.empty() || bias.size() == b.size(), "bias must be empty or have one value per row of b");
  const lora::ExtendedK e = lora::extended_k(r, b_is_fp32, !bias.empty());
  Matrix u(xa.size(), std::vector<float>(e.width)), v(b.size(), std::vector<float>(e.width));
  for (size_t i = 0; i < xa.size(); ++i)
    for (int64_t col = 0; col < e.width; ++col) u[i][col] = lora::extended_u(e, xa[i].data(), scaling, col);
  for (size_t o = 0; o < b.size(); ++o)
    for (int64_t col = 0; col < e.width; ++col) {
      const float b_value = col < e.terms * r ? b[o][col % r] : 0.0f;
      v[o][col] = lora::extended_v(e, b_is_fp32 ? b_value : lora::bf16_rounded(b_value),
                                   bias.empty() ? 0.0f : lora::bf16_rounded(bias[o]), col);
    }
  return {e.terms, e.width, u, v};
}

// lora/lora_rank_pieces.h, as the CUDA side lays the operands out: `layout` names one of the
// operands (three pieces side by side or stacked, or one of the grad_x term's six-block operands).
lora::PieceLayout piece_layout(const std::string& layout, int64_t rows, int64_t cols) {
  if (layout == "side_by_side") return lora::three_pieces(rows, cols, false);
  if (layout == "stacked") return lora::three_pieces(rows, cols, true);
  if (layout == "dxa_term") return lora::dxa_term_pieces(rows, cols);
  if (layout == "a_term") return lora::a_term_pieces(rows, cols);
  require(false, "layout must be side_by_side, stacked, dxa_term or a_term");
  return {};
}

// The blocked bf16 operand (as floats, row-major) of an fp32 [rows, cols] matrix (row-major values).
std::vector<float> lora_split_pieces(const std::vector<float>& values, int64_t rows, int64_t cols,
                                     const std::string& layout) {
  require(rows >= 0 && cols >= 0 && static_cast<int64_t>(values.size()) == rows * cols, "values must be rows x cols");
  const lora::PieceLayout l = piece_layout(layout, rows, cols);
  std::vector<float> out(values.size() * l.blocks);
  for (int b = 0; b < l.blocks; ++b)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        out[lora::piece_offset(l, b, i, j)] = lora::bf16_piece(values[i * cols + j], l.piece[b]);
  return out;
}

// [rows, cols] from an fp32 product laid out with three blocks side by side or stacked.
std::vector<float> lora_sum_pieces(const std::vector<float>& product, int64_t rows, int64_t cols, bool stacked) {
  require(rows >= 0 && cols >= 0 && static_cast<int64_t>(product.size()) == 3 * rows * cols,
          "product must hold three rows x cols blocks");
  const lora::PieceLayout l = lora::three_pieces(rows, cols, stacked);
  std::vector<float> out(rows * cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = lora::sum_pieces_at(l, product.data(), i, j);
  return out;
}

// Binds a two-way knob's parser (common/two_way_choice.h) as name(setting) -> the choice it names:
// if_set when the parser sets its flag, else if_clear; a bad setting raises the parser's message.
void def_two_way_knob(py::module_& m, const char* name, const char* (*parse)(const char*, bool*), const char* if_set,
                      const char* if_clear) {
  m.def(
      name,
      [parse, if_set, if_clear](const std::optional<std::string>& setting) {
        bool flag = false;
        const char* error = parse(setting ? setting->c_str() : nullptr, &flag);
        require(error == nullptr, error ? error : "");
        return std::string(flag ? if_set : if_clear);
      },
      py::arg("setting"));
}

}  // namespace

void define_host_logic(py::module_& m) {
  // nf4/nf4_decode_bf16.h: the QLoRA GEMM's register decode of one word of 8 codes (4 bf16 pairs),
  // prmt through its host twin; nf4/nf4_gemm_sm90.h: the launcher's check and the knob
  m.def("nf4_byte_perm", &nf4::byte_perm, py::arg("a"), py::arg("b"), py::arg("selector"));
  m.def("nf4_transposed_scale_block", &nf4::transposed_scale_block, py::arg("o"), py::arg("rows"), py::arg("groups"));
  // nf4/nf4_layout.h: the dequantize's block lookups, a shift for a power-of-two divisor
  m.def(
      "nf4_divide",
      [](int64_t i, int64_t d) {
        const nf4::Divider by = nf4::divider(d);  // as the dequantize's launcher picks its kernel
        return std::make_tuple(nf4_kernel_divide(by, i, by.shift >= 0), by.shift);
      },
      py::arg("i"), py::arg("d"));
  m.def(
      "nf4_decode_word_bf16",
      [](uint32_t word) {
        uint32_t out[4];
        nf4::decode_nf4_word_bf16(word, out);
        return std::vector<uint32_t>(out, out + 4);
      },
      py::arg("word"));
  m.attr("nf4_code_bf16") = std::vector<int>(std::begin(nf4::kCodeBf16), std::end(nf4::kCodeBf16));
  m.def(
      "nf4_gemm_sm90_error",
      [](int64_t m_rows, int64_t n, int64_t k, int64_t blocksize, bool misaligned) -> py::object {
        nf4::Nf4GemmSm90Params p{};
        p.m = m_rows, p.n = n, p.k = k, p.blocksize = blocksize;
        p.x = fake_address(0, false), p.packed = static_cast<const uint8_t*>(fake_address(1, misaligned));
        p.scales = fake_address(2, false), p.y = const_cast<void*>(fake_address(3, false));
        const char* error = nf4::nf4_gemm_sm90_error(p);
        return error ? py::object(py::str(error)) : py::object(py::none());
      },
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("blocksize"), py::arg("misaligned") = false);
  def_two_way_knob(m, "nf4_sm90_forward", &nf4::nf4_sm90_forward_for, "mainloop", "dequantize");
  // lora/lora_extended_k.h: (terms, width, U, V), the PYKERNELS_SM90_LORA and _GRAD_X knobs
  m.def("lora_extended_k_operands", &lora_extended_k_operands, py::arg("xa"), py::arg("b"), py::arg("bias"),
        py::arg("scaling"), py::arg("b_is_fp32"));
  m.def("lora_bf16_rounded", &lora::bf16_rounded, py::arg("value"));
  m.attr("lora_extended_k_tile") = lora::kExtendedKTile;
  def_two_way_knob(m, "lora_sm90_forward", &lora::lora_sm90_forward_for, "cublas", "extended_k");
  def_two_way_knob(m, "lora_sm90_grad_x", &lora::lora_sm90_grad_x_for, "extended_k", "cublas");
  // lora/lora_rank_pieces.h: the PYKERNELS_LORA_RANK_GEMM knob, an fp32 value's three bf16 pieces,
  // and the blocked operands / the sum of a blocked product
  def_two_way_knob(m, "lora_rank_gemm", &lora::lora_rank_gemm_for, "simt", "tensor_core");
  m.def("lora_bf16_piece", &lora::bf16_piece, py::arg("value"), py::arg("piece"));
  m.def("lora_split_pieces", &lora_split_pieces, py::arg("values"), py::arg("rows"), py::arg("cols"),
        py::arg("layout"));
  m.def("lora_sum_pieces", &lora_sum_pieces, py::arg("product"), py::arg("rows"), py::arg("cols"),
        py::arg("stacked"));
  // lora/lora.h: (tile_m, tile_n, splits, k_per_split, workspace_floats); which rows / columns of its
  // tile a thread accumulates, its (tx, ty), and the shared-memory row stride
  m.def("lora_rank_gemm_plan", &lora_rank_gemm_plan, py::arg("m"), py::arg("n"), py::arg("k"), py::arg("sms"));
  m.def("lora_nf4_chunk_rows", &lora_nf4_chunk_rows, py::arg("n"), py::arg("k"), py::arg("m"),
        py::arg("element_size"), py::arg("sms"), py::arg("setting") = std::nullopt);
  m.def("lora_rank_fragment_index", &lora::rank_fragment_index, py::arg("extent"), py::arg("t"), py::arg("i"));
  m.def(
      "lora_rank_thread",
      [](int64_t tile_m, int thread) {
        const lora::RankThread t = lora::rank_thread(tile_m, thread);
        return std::make_tuple(t.tx, t.ty);
      },
      py::arg("tile_m"), py::arg("thread"));
  m.def("lora_rank_smem_stride", &lora::rank_smem_stride, py::arg("extent"));
  // common/tails.h
  m.def("elements_in_range", &elements_in_range, py::arg("first"), py::arg("width"), py::arg("numel"));
  m.def("whole_vector_in_range", &whole_vector_in_range, py::arg("first"), py::arg("width"), py::arg("numel"));
  m.def(
      "is_aligned",
      [](uintptr_t address, uintptr_t bytes) { return is_aligned(reinterpret_cast<const void*>(address), bytes); },
      py::arg("address"), py::arg("bytes"));
  m.def(
      "rows_vector_aligned",
      [](uintptr_t address, int64_t ld, int64_t extent, int elements, int element_bytes) {
        return rows_vector_aligned(reinterpret_cast<const void*>(address), ld, extent, elements, element_bytes);
      },
      py::arg("address"), py::arg("ld"), py::arg("contiguous_extent"), py::arg("elements"), py::arg("element_bytes"));
  // common/online_softmax.h: partials are (max_z, sum_exp, sum_exp_z) in fp32
  m.def(
      "softmax_merge",
      [](const Partial& a, const Partial& b) { return from_partial(merge_partials(to_partial(a), to_partial(b))); },
      py::arg("a"), py::arg("b"));
  m.def(
      "softmax_fold_chunk",
      [](const Partial& running, float new_max, float chunk_sum_exp, float chunk_sum_exp_z) {
        return from_partial(fold_chunk(to_partial(running), new_max, chunk_sum_exp, chunk_sum_exp_z));
      },
      py::arg("running"), py::arg("new_max"), py::arg("chunk_sum_exp"), py::arg("chunk_sum_exp_z"));
  m.def("softmax_merge_all", &softmax_merge_all, py::arg("partials"));
  m.def("softmax_add_logits", &softmax_add_logits, py::arg("logits"), py::arg("slack") = 0.0f);
  m.attr("softmax_lazy_max_slack") = kLazyMaxSlack;
  m.def(
      "softmax_summarize",
      [](const Partial& p) {
        const SoftmaxSummary s = summarize_partial(to_partial(p));
        return std::make_pair(s.lse, s.entropy);
      },
      py::arg("partial"), "(lse, entropy)");
  // nf4/nf4_layout.h
  m.def("nf4_packed_byte_of", &nf4::packed_byte_of, py::arg("i"));
  m.def("nf4_packed_bytes", &nf4::packed_bytes, py::arg("numel"));
  m.def("nf4_block_of", &nf4::block_of, py::arg("i"), py::arg("blocksize"));
  m.def("nf4_block_is_partial", &nf4::block_is_partial, py::arg("block"), py::arg("blocksize"), py::arg("numel"));
  m.def("nf4_nested_block_of", &nf4::nested_block_of, py::arg("block"), py::arg("nested_blocksize"));
  m.def("nf4_code_of_element", &nf4::code_of_element, py::arg("byte"), py::arg("i"));
  m.def("nf4_unpack_codes", &nf4_unpack_codes, py::arg("packed"), py::arg("numel"));
  m.def("nf4_pack_word", &nf4_pack_word, py::arg("codes"));
  m.def("nf4_decode_absmax", &nf4::decode_absmax, py::arg("nested_code_value"), py::arg("nested_absmax"),
        py::arg("nested_offset"));
  m.def("nf4_dequantize_value", &nf4::dequantize_value, py::arg("code_value"), py::arg("absmax"));
  m.def("nf4_dequantize_double_quant", &nf4_dequantize_double_quant, py::arg("packed"), py::arg("numel"),
        py::arg("blocksize"), py::arg("absmax_q"), py::arg("nested_code"), py::arg("nested_absmax"),
        py::arg("nested_offset"), py::arg("nested_blocksize"));
  m.def("nf4_dequantize_warps", &nf4_dequantize_warps, py::arg("packed"), py::arg("numel"), py::arg("blocksize"),
        py::arg("absmax"), py::arg("unit_values"));
  m.def("nf4_warp_unit_offset", &nf4::warp_unit_offset, py::arg("u"), py::arg("lane"), py::arg("unit_values"));
  def_two_way_knob(m, "nf4_dequantize_kernel", &nf4::dequantize_units_for, "units", "warps");
  // moe/moe_schedule.h
  m.def("moe_bucket_slots", &moe_bucket_slots, py::arg("offsets"), py::arg("slots"));
  m.def("moe_row_tile_schedule", &moe_row_tile_schedule, py::arg("offsets"), py::arg("slots"),
        py::arg("rows_per_tile"));
  m.def(
      "moe_grid_tile",
      [](int64_t cta, int64_t column_tiles) {
        require(cta >= 0 && column_tiles >= 1, "need cta >= 0 and column_tiles >= 1");
        const moe::GridTile t = moe::grid_tile(cta, column_tiles);
        return std::make_pair(t.row, t.column);
      },
      py::arg("cta"), py::arg("column_tiles"));
  m.def("moe_max_row_tiles", &moe::max_row_tiles, py::arg("slots"), py::arg("experts"), py::arg("rows_per_tile"));
  m.def("moe_expert_bucket", &moe::expert_bucket, py::arg("id"), py::arg("experts"));
  m.def("moe_assignment_of", &moe::assignment_of, py::arg("token"), py::arg("k_slot"), py::arg("top_k"));
  m.def("moe_routing_maps", &moe_routing_maps, py::arg("sorted_token_idx"), py::arg("offsets"), py::arg("top_k"));
  m.def("moe_slot_row_index", &moe_slot_row_index, py::arg("map"), py::arg("s"), py::arg("rows"));
  // common/gemm_sm90_dense.h, common/grouped_gemm_sm90.h
  m.def("gemm_sm90_dense", &gemm_sm90_dense, py::arg("m"), py::arg("n"), py::arg("k"), py::arg("lda"),
        py::arg("ldb"), py::arg("ldd"), py::arg("a_transposed"), py::arg("b_transposed"), py::arg("ab_dtype"),
        py::arg("d_dtype"), py::arg("accumulate"), py::arg("misaligned") = false);
  m.def("gemm_sm90_plain_takes", &gemm_sm90_plain_takes, py::arg("a_transposed"), py::arg("b_transposed"),
        py::arg("d_dtype"), py::arg("tile"), py::arg("extra_k") = false, py::arg("grouped") = false,
        py::arg("gated") = false, py::arg("gathered") = false);
  def_two_way_knob(m, "gemm_sm90_dense_kernel", &gemm::sm90_dense_plain_for, "plain", "array");
  m.def("gemm_sm90_gated_error", &gemm_sm90_gated_error, py::arg("kind"), py::arg("n"), py::arg("k"), py::arg("tile"),
        py::arg("d_dtype") = "bf16", py::arg("accumulate") = false, py::arg("k2") = 0);
  m.def("gemm_paired_rows_tile", &gemm_paired_rows_tile, py::arg("inner"), py::arg("k"), py::arg("ldb"),
        py::arg("block_n"), py::arg("cluster_m"), py::arg("n_tile"));
  m.def("gemm_paired_weight_row", &gemm::paired_weight_row, py::arg("n"), py::arg("inner"));
  m.def(
      "gemm_paired_rows_error",
      [](int64_t n, int64_t k, int64_t ldb, int64_t block_n, int64_t cluster_m) -> py::object {
        const char* error = gemm::paired_rows_error(n, k, ldb, 2, block_n, gemm::kSm90TileK, cluster_m);
        return error ? py::object(py::str(error)) : py::object(py::none());
      },
      py::arg("n"), py::arg("k"), py::arg("ldb"), py::arg("block_n"), py::arg("cluster_m"));
  m.def("gemm_sm90_error", &gemm_sm90_error, py::arg("kind"), py::arg("grouped"), py::arg("experts"),
        py::arg("slots"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("lda"), py::arg("ldb"),
        py::arg("b_expert_stride"), py::arg("ldd"), py::arg("d_expert_stride"), py::arg("d_dtype"),
        py::arg("accumulate"), py::arg("zeros"));
  m.def("gemm_sm90_extra_k_error", &gemm_sm90_extra_k_error, py::arg("kind"), py::arg("n"), py::arg("k"),
        py::arg("k2"), py::arg("lda2"), py::arg("ldb2"), py::arg("b2_expert_stride"), py::arg("d_dtype") = "bf16",
        py::arg("misaligned") = false, py::arg("grouped") = true, py::arg("ldd") = 0);
  m.def("gemm_sm90_extra_k_groups", &gemm_sm90_extra_k_groups, py::arg("offsets"), py::arg("slots"), py::arg("k"),
        py::arg("k2"), py::arg("lda2"), py::arg("b2_expert_stride"), py::arg("block_k"));
  def_two_way_knob(m, "moe_sm90_lora", &moe::moe_lora_separate_for, "separate", "extra_k");
  def_two_way_knob(m, "moe_sm90_gather", &moe::moe_gather_in_mainloop_for, "mainloop", "pass");
  def_two_way_knob(m, "moe_rank_tile", &moe::moe_rank_tile_narrow_for, "narrow", "wide");
  m.def(
      "gemm_sm90_tile_order",
      [](const std::optional<std::string>& setting) {
        gemm::Sm90TileOrder order;
        const char* error = gemm::sm90_tile_order_for(setting ? setting->c_str() : nullptr, &order);
        require(error == nullptr, error ? error : "");
        return std::make_tuple(order.along_n ? "n" : "m", order.swizzle);
      },
      py::arg("setting"));
  m.attr("gemm_sm90_tile_orders") = std::vector<std::string>(std::begin(gemm::kSm90TileOrders),
                                                             std::end(gemm::kSm90TileOrders));
  m.def("gemm_sm90_tile", &gemm_sm90_tile, py::arg("setting"), py::arg("kind"), py::arg("experts"), py::arg("slots"),
        py::arg("m"), py::arg("n"));
  {
    std::vector<std::string> tiles;
    for (const gemm::Sm90Tile tile : gemm::kSm90Tiles) tiles.emplace_back(gemm::sm90_tile_name(tile));
    m.attr("gemm_sm90_tiles") = tiles;
  }
  // common/gemm_groups.h
  m.def("gemm_sm90_groups", &gemm_sm90_groups, py::arg("kind"), py::arg("offsets"), py::arg("slots"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("lda"), py::arg("ldb"), py::arg("b_expert_stride"), py::arg("ldd"),
        py::arg("d_expert_stride"));
  // logprobs/vocab_chunks.h
  m.attr("logprobs_vocab_chunk") = logprobs::kVocabChunk;
  m.attr("logprobs_token_chunk") = logprobs::kTokenChunk;
  m.def("logprobs_chunks", &logprobs_chunks, py::arg("extent"), py::arg("chunk"));
  m.def("logprobs_padded_row_length", &logprobs::padded_row_length, py::arg("cols"));
  m.def("logprobs_target_column", &logprobs::target_column, py::arg("target"), py::arg("v0"), py::arg("cols"));
  m.def("logprobs_target_out_of_vocab", &logprobs::target_out_of_vocab, py::arg("target"), py::arg("ignore_index"),
        py::arg("vocab"));
  m.def("logprobs_target_claims", &logprobs_target_claims, py::arg("targets"), py::arg("vocab"), py::arg("chunk"));
  m.attr("logprobs_sm90_vocab_chunk") = logprobs::kSm90VocabChunk;
  m.attr("logprobs_sm90_row_pad") = logprobs::kSm90RowPad;
  {
    std::vector<std::string> tiles;
    for (const logprobs::LogprobsSm90Tile tile : logprobs::kLogprobsSm90Tiles)
      tiles.emplace_back(logprobs::logprobs_sm90_tile_name(tile));
    m.attr("logprobs_sm90_tiles") = tiles;
  }
  m.def("logprobs_sm90_stats", &logprobs_sm90_stats, py::arg("logits"), py::arg("slack") = 0.0f);
  def_two_way_knob(m, "logprobs_sm90_fold", &logprobs::logprobs_sm90_lazy_fold_for, "lazy_max", "running_max");
  m.def(
      "logprobs_sm90_tile",
      [](const std::optional<std::string>& setting) {
        logprobs::LogprobsSm90Tile tile{};
        const char* error = logprobs::logprobs_sm90_tile_for(setting ? setting->c_str() : nullptr, &tile);
        require(error == nullptr, error ? error : "");
        return std::string(logprobs::logprobs_sm90_tile_name(tile));
      },
      py::arg("setting"));
  // logprobs/logit_grad.h, logprobs/logprobs_sm90.h
  m.def("logprobs_logit_grad", &logprobs::logit_grad, py::arg("z"), py::arg("lse"), py::arg("shift"), py::arg("g_lp"),
        py::arg("g_ent"), py::arg("target"));
  m.def(
      "logprobs_sm90_error",
      [](int64_t tokens, int64_t rows, int64_t h, uintptr_t hidden, uintptr_t weight, int64_t ld, uintptr_t dz) {
        const char* error = logprobs_sm90_error(tokens, rows, h, hidden, weight, ld, dz);
        return error == nullptr ? std::string() : std::string(error);
      },
      py::arg("tokens"), py::arg("rows"), py::arg("h"), py::arg("hidden") = 0, py::arg("weight") = 0,
      py::arg("ld") = 0, py::arg("dz") = 0);
}

}  // namespace pykernels
