// CUDA implementations of the grouped MoE ops (schemas in csrc/torch_bindings.cpp; the same results
// as moe_cpu.cpp up to rounding): checks, allocation on the current device and the composition of
// the launchers in moe.cu on torch's current stream. Nothing here reads device memory on the host:
// no synchronization, so the routing values are not validated (moe.h says what happens instead).
//
// With slot s of expert e, gate g_s (1 without gates) and u, v the rank-r LoRA activations:
//   forward   u_s  = scaling x_s A_e^T                      grouped rows GEMM [slots, r8]
//             y_s  = g_s (x_s W_e^T + u_s B_e^T)            grouped rows GEMM, LoRA as extra K-steps,
//                                                           rows scattered to slot / assignment order
//                                                           or to a workspace summed per token
//   backward  v_s  = scaling dy_s B_e                       grouped rows GEMM [slots, r8]
//             dx_s = g_s (dy_s W_e + v_s A_e)               grouped rows GEMM whose epilogue also
//             dg_s = (dy_s W_e + v_s A_e) . x_s             leaves per-column-tile partial dots
//             dW_e = sum_s g_s dy_s^T x_s                   slot-reduction GEMMs (one CTA per output
//             dB_e = sum_s g_s dy_s^T u_s                   tile sums all of an expert's slots:
//             dA_e = sum_s g_s v_s^T x_s                    deterministic)
// u and v are rounded to x's dtype (like the CPU's bf16 path) and padded to r8 = r rounded up to 8
// columns of zeros, which keeps their rows 16-byte aligned for the tensor-core kernels.
//
// Expert weights stored [E, in, out] (GPT-OSS; the op gets a transposed view) are read in place by the
// sm_90a GEMMs (the B operand's other major-ness); the sm80 kernels take a contiguous [E, out, in]
// copy per call.
//
// On Hopper (compute capability 9.0, bf16, feature sizes multiples of 8) the products with W run
// as CUTLASS sm_90a grouped GEMMs on rows in slot order (common/grouped_gemm_sm90.cu), the LoRA
// products on the base's rows (u B^T, v A) as extra K of the same GEMMs (no second pass over the
// rows). The gather of x / dy into slot order, the scatter and
// the gate gradient's dots are separate passes around them, and the gates ride on the per-token
// sum (the sm80 kernels fuse the gather, gates and dots; the sm_90a epilogues do not). The per-token
// sum stays a pass on both: in an epilogue it would take fp32 atomics, run-to-run rounding and no
// fewer bytes (README, "On a GPU machine"). PYKERNELS_SM90=0 keeps the sm80 kernels on Hopper.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>

#include "common/env_knob.h"
#include "common/gemm_sm90_torch.h"
#include "common/tails.h"
#include "moe/gate_up_act.h"
#include "moe/gated_act.h"
#include "moe/moe.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, error); }

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

DType dtype_of(const at::Tensor& t) { return float_dtype(t.scalar_type(), "tensor"); }

const int64_t* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<int64_t>() : nullptr; }

// Rows of a contiguous 2-D tensor read by slot through map (undefined: slot s reads row s).
SlotRows slot_rows(const at::Tensor& t, const at::Tensor& map = {}) {
  return {t.data_ptr(), t.size(1), t.size(0), t.size(1), data_or_null(map)};
}

// A contiguous [E, N, K] tensor as b_e[n, k], or a contiguous [E, K, N] tensor as b_e[n, k] whose
// rows at k >= k_limit read as zero.
ExpertMatrix k_major(const at::Tensor& w) { return {w.data_ptr(), w.size(1) * w.size(2), w.size(2), 1, w.size(2)}; }
ExpertMatrix n_major(const at::Tensor& w, int64_t k_limit) {
  return {w.data_ptr(), w.size(1) * w.size(2), 1, w.size(2), k_limit};
}

// Everything one call needs, shared by forward and backward.
struct Problem {
  Sizes size;
  at::Tensor x, weight, sorted_token_idx, expert_offsets;
  bool weight_n_major;       // weight [E, out, in] is a transposed view of a contiguous [E, in, out] tensor
  at::Tensor gates;          // [T * k] contiguous, or undefined
  at::Tensor lora_a, lora_b; // contiguous, or undefined
  float scaling;
  bool grouped_in, grouped_out;
  cudaStream_t stream;
  // Per-slot maps (moe.h, launch_routing_maps).
  at::Tensor token_of_slot, slot_of_assignment, gate_of_slot;

  bool lora() const { return lora_a.defined(); }
  bool summed() const { return gates.defined() && !grouped_out; }  // output rows summed per token
  int64_t padded_rank() const { return (size.rank + 7) / 8 * 8; }
  SlotRows x_rows() const { return slot_rows(x, grouped_in ? at::Tensor() : token_of_slot); }
  at::Tensor lora_a_by_expert() const { return lora_a.view({size.experts, size.rank, size.in}); }  // A_e = [e]
  // The weight as the sm80 kernels read it, contiguous [E, out, in] (a copy for transposed storage).
  at::Tensor k_major_weight() const { return weight_n_major ? weight.contiguous() : weight; }
};

// Inputs already checked (check_grouped_linear: shapes, dtypes, devices), under a guard of x's device.
Problem make_problem(const Sizes& size, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, bool grouped_in,
                     bool grouped_out, const std::optional<at::Tensor>& gates,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     double scaling) {
  TORCH_CHECK_VALUE(size.slots < (int64_t{1} << 31), "the number of assignments T * k must be below 2^31, got ",
                    size.slots);
  const bool n_major = !weight.is_contiguous() && weight.transpose(1, 2).is_contiguous();
  Problem p{size, x.contiguous(), n_major ? weight : weight.contiguous(), sorted_token_idx, expert_offsets, n_major,
            gates ? gates->reshape(-1).contiguous() : at::Tensor(),
            lora_a ? lora_a->contiguous() : at::Tensor(), lora_b ? lora_b->contiguous() : at::Tensor(),
            static_cast<float>(scaling), grouped_in, grouped_out, current_stream(x), {}, {}, {}};
  const auto long_options = sorted_token_idx.options();
  p.token_of_slot = at::empty({p.size.slots}, long_options);
  p.slot_of_assignment = at::empty({p.size.slots}, long_options);
  RoutingMapsParams maps{sorted_token_idx.data_ptr<int64_t>(), expert_offsets.data_ptr<int64_t>(), p.size.slots,
                         p.size.experts, p.size.top_k, p.token_of_slot.data_ptr<int64_t>(),
                         p.slot_of_assignment.data_ptr<int64_t>(), nullptr, DType::kFloat32, nullptr};
  if (p.gates.defined()) {
    p.gate_of_slot = at::empty({p.size.slots}, x.options().dtype(at::kFloat));
    maps.gates = p.gates.data_ptr();
    maps.gates_dtype = dtype_of(p.gates);
    maps.gate_of_slot = p.gate_of_slot.data_ptr<float>();
  }
  check_launch(launch_routing_maps(maps, p.stream));
  return p;
}

// Whether the rank-r products take the sm80 kernels' narrow tile (PYKERNELS_MOE_RANK_TILE, moe.h).
bool narrow_rank_tile() { return env_knob<bool>("PYKERNELS_MOE_RANK_TILE", moe_rank_tile_narrow_for); }

// A rows GEMM over every slot with n_cols output columns; the caller fills in operands and output.
GroupedRowsParams rows_gemm(const Problem& p, int64_t n_cols) {
  GroupedRowsParams g{};
  g.dtype = dtype_of(p.x);
  g.slots = p.size.slots;
  g.experts = p.size.experts;
  g.n_cols = n_cols;
  g.expert_offsets = p.expert_offsets.data_ptr<int64_t>();
  g.alpha = 1.0f;
  g.out_rows = p.size.slots;
  g.narrow_rank_tile = narrow_rank_tile();
  return g;
}

void run_rows_gemm(const GroupedRowsParams& g, const Problem& p) {
  const at::Tensor workspace = at::empty({grouped_rows_workspace_bytes(g)}, p.x.options().dtype(at::kByte));
  check_launch(launch_grouped_rows(g, workspace.data_ptr(), p.stream));
}

// out[e * expert_stride + m * ld_m + n * ld_n] = sum over the slots s of expert e of a[s, m] b[s, n].
void weight_grad_gemm(const Problem& p, SlotRows a, SlotRows b, int64_t m_rows, int64_t n_cols, at::Tensor& out,
                      int64_t expert_stride, int64_t ld_m, int64_t ld_n) {
  GroupedWeightGradParams g{dtype_of(p.x), p.size.slots, p.size.experts, m_rows, n_cols,
                            p.expert_offsets.data_ptr<int64_t>(), a, b, 1.0f, out.data_ptr(), expert_stride,
                            ld_m, ld_n, narrow_rank_tile()};
  check_launch(launch_grouped_weight_grad(g, p.stream));
}

// Rows [slots, cols] in slot order -> [T, cols], each token's k rows summed (dropped ones skipped),
// each times its slot's gate when `gated` (the rows are not gated yet).
at::Tensor sum_per_token(const Problem& p, const at::Tensor& slot_rows_in, bool gated = false) {
  at::Tensor out = at::empty({p.size.tokens, slot_rows_in.size(1)}, slot_rows_in.options());
  SumPerTokenParams s{dtype_of(out), slot_rows_in.data_ptr(), p.slot_of_assignment.data_ptr<int64_t>(),
                      p.size.tokens, p.size.top_k, slot_rows_in.size(1), out.data_ptr(),
                      gated && p.gates.defined() ? p.gate_of_slot.data_ptr<float>() : nullptr};
  check_launch(launch_sum_per_token(s, p.stream));
  return out;
}

// src's slot rows times each slot's gate, in slot order [slots, src.cols]; src itself without gates.
SlotRows gated(const Problem& p, SlotRows src, at::Tensor& storage) {
  if (!p.gates.defined()) return src;
  storage = at::empty({p.size.slots, src.cols}, p.x.options());
  ScaleRowsParams s{dtype_of(p.x), p.size.slots, src, p.gate_of_slot.data_ptr<float>(), storage.data_ptr(),
                    src.cols};
  check_launch(launch_scale_rows(s, p.stream));
  return slot_rows(storage);
}

// u = scaling x_s A_e^T [slots, r8] in slot order (padding columns zero).
at::Tensor lora_u(const Problem& p) {
  at::Tensor u = at::zeros({p.size.slots, p.padded_rank()}, p.x.options());
  GroupedRowsParams g = rows_gemm(p, p.size.rank);
  g.a = p.x_rows();
  g.b = k_major(p.lora_a_by_expert());
  g.alpha = p.scaling;
  g.out = u.data_ptr();
  g.ld_out = u.size(1);
  run_rows_gemm(g, p);
  return u;
}

// B_e = lora_b[:, e::E] as [E, out, r8] (B_e contiguous, padding columns zero).
at::Tensor lora_b_by_expert(const Problem& p) {
  const Sizes& z = p.size;
  at::Tensor b = at::zeros({z.experts, z.out, p.padded_rank()}, p.x.options());
  b.narrow(2, 0, z.rank).copy_(p.lora_b.view({z.out, z.rank, z.experts}).permute({2, 0, 1}));
  return b;
}

// ------------------------------------------------------------------ sm_90a path
// Whether the grouped GEMMs of this problem run on the sm_90a kernels: bf16, row strides that TMA
// accepts (multiples of 8 elements) and 16-byte aligned operands, on a compute capability 9.0 device.
// No slots (T = 0) stays on the sm80 kernels, which write the empty outputs and zero gradients: the
// Hopper GEMMs would get null operands (an empty tensor's data), which TMA descriptors refuse.
bool use_sm90(const Problem& p, std::initializer_list<at::Tensor> operands) {
  if (p.x.scalar_type() != at::kBFloat16 || p.size.in % 8 != 0 || p.size.out % 8 != 0 || p.size.slots == 0)
    return false;
  for (const at::Tensor& t : operands)
    if (t.defined() && !is_aligned(t.data_ptr(), 16)) return false;
  return gemm::sm90_usable(static_cast<int>(p.x.get_device()));
}

using gemm::GroupedGemmSm90Params;
using gemm::Sm90GemmKind;

GroupedGemmSm90Params sm90_gemm(const Problem& p, Sm90GemmKind kind) {
  GroupedGemmSm90Params g{};
  g.kind = kind;
  g.slots = p.size.slots;
  g.experts = p.size.experts;
  g.expert_offsets = p.expert_offsets.data_ptr<int64_t>();
  g.d_dtype = DType::kBFloat16;
  g.alpha = 1.0f;
  return g;
}

void run_sm90(const Problem& p, const GroupedGemmSm90Params& g) {
  gemm::run_grouped_gemm_sm90(g, static_cast<int>(p.x.get_device()), p.stream);
}

// A second operand pair of a rows GEMM (extra K, common/grouped_gemm_sm90.h): a2 [slots, k2]
// contiguous and B2_e at e * b2_expert_stride in B's layout with row stride ldb2.
struct ExtraK {
  const at::Tensor* a2;
  int64_t k2;
  const at::Tensor* b2;
  int64_t ldb2, b2_expert_stride;
};

// Whether the LoRA products ride as extra K (PYKERNELS_SM90_MOE_LORA, moe.h).
bool lora_as_extra_k() { return !env_knob<bool>("PYKERNELS_SM90_MOE_LORA", moe_lora_separate_for); }

// Whether the rows GEMMs that can gather their A rows do so in their mainloop (PYKERNELS_SM90_MOE_GATHER).
bool gather_in_mainloop() { return env_knob<bool>("PYKERNELS_SM90_MOE_GATHER", moe_gather_in_mainloop_for); }

// D[s] (+)= A[s] B_e^T (B_e [n, k] with row stride ldb) or A[s] B_e (B_e [k, n]) for the slots of
// each expert, + A2[s] op(B2_e) in the same accumulation with extra K (or, under
// PYKERNELS_SM90_MOE_LORA=separate, as a second GEMM accumulating into D); A [slots, >= k] and D
// [slots, n] contiguous, or with a_rows (int64 [slots]) A's row of slot s is a[a_rows[s]], gathered
// by the GEMM (kRowsNMajorB only).
void sm90_rows(const Problem& p, Sm90GemmKind kind, const at::Tensor& a, int64_t k, const at::Tensor& b,
               int64_t ldb, int64_t b_expert_stride, at::Tensor& d, bool accumulate,
               const std::optional<ExtraK>& extra = std::nullopt, const at::Tensor& a_rows = {}) {
  if (extra.has_value() && !lora_as_extra_k()) {
    sm90_rows(p, kind, a, k, b, ldb, b_expert_stride, d, accumulate, std::nullopt, a_rows);
    sm90_rows(p, kind, *extra->a2, extra->k2, *extra->b2, extra->ldb2, extra->b2_expert_stride, d, true);
    return;
  }
  GroupedGemmSm90Params g = sm90_gemm(p, kind);
  if (a_rows.defined()) g.a_rows = a_rows.data_ptr<int64_t>();
  if (extra.has_value()) {
    g.a2 = extra->a2->data_ptr();
    g.lda2 = extra->a2->size(1);
    g.k2 = extra->k2;
    g.b2 = extra->b2->data_ptr();
    g.ldb2 = extra->ldb2;
    g.b2_expert_stride = extra->b2_expert_stride;
  }
  g.n = d.size(1);
  g.k = k;
  g.a = a.data_ptr();
  g.lda = a.size(1);
  g.b = b.data_ptr();
  g.ldb = ldb;
  g.b_expert_stride = b_expert_stride;
  g.d = d.data_ptr();
  g.ldd = d.size(1);
  g.c = accumulate ? g.d : nullptr;  // in place
  g.beta = accumulate ? 1.0f : 0.0f;
  run_sm90(p, g);
}

// t's rows in slot order: slot s gets row map[s] (zeros outside t); t itself without a map.
at::Tensor in_slot_order(const Problem& p, const at::Tensor& t, const at::Tensor& map) {
  if (!map.defined()) return t;
  at::Tensor out = at::empty({p.size.slots, t.size(1)}, t.options());
  ScaleRowsParams s{dtype_of(t), p.size.slots, slot_rows(t, map), nullptr, out.data_ptr(), t.size(1)};
  check_launch(launch_scale_rows(s, p.stream));
  return out;
}

// rows[s] *= gate_of_slot[s] in place (nothing without gates).
void apply_gates(const Problem& p, at::Tensor& rows) {
  if (!p.gates.defined()) return;
  ScaleRowsParams s{dtype_of(rows), p.size.slots, slot_rows(rows), p.gate_of_slot.data_ptr<float>(),
                    rows.data_ptr(), rows.size(1)};
  check_launch(launch_scale_rows(s, p.stream));
}

// Zero the rows of the dropped bucket, which no expert's GEMM writes.
void zero_dropped_rows(const Problem& p, at::Tensor& rows) {
  ZeroDroppedRowsParams z{dtype_of(rows), p.size.slots, p.size.experts, p.expert_offsets.data_ptr<int64_t>(),
                          rows.data_ptr(), rows.size(1), rows.size(1)};
  check_launch(launch_zero_dropped_rows(z, p.stream));
}

at::Tensor grouped_linear_sm90(const Problem& p) {
  const Sizes& z = p.size;
  const at::Tensor xs = in_slot_order(p, p.x, p.grouped_in ? at::Tensor() : p.token_of_slot);
  at::Tensor rows = at::empty({z.slots, z.out}, p.x.options());  // slot order, ungated
  // With LoRA, u B_e^T is extra K of the same GEMM (u [slots, r8], B_e zero-padded to r8 columns, so
  // every TMA extent is a multiple of 16 bytes), laid out like the weight: no second pass over rows.
  at::Tensor u, b;
  std::optional<ExtraK> lora_term;
  if (p.lora()) {
    const int64_t r8 = p.padded_rank();
    u = lora_u(p);
    b = lora_b_by_expert(p);  // [E, out, r8]
    if (p.weight_n_major) b = b.transpose(1, 2).contiguous();  // [E, r8, out]: N-major like W_e^T
    lora_term = ExtraK{&u, r8, &b, p.weight_n_major ? z.out : r8, z.out * r8};
  }
  if (p.weight_n_major) {  // W_e^T, the stored [in, out] matrix, as B [k, n]
    sm90_rows(p, Sm90GemmKind::kRowsNMajorB, xs, z.in, p.weight, z.out, z.out * z.in, rows, false, lora_term);
  } else {
    sm90_rows(p, Sm90GemmKind::kRowsKMajorB, xs, z.in, p.weight, z.in, z.out * z.in, rows, false, lora_term);
  }
  if (p.summed()) return sum_per_token(p, rows, /*gated=*/true);  // gates applied in the sum
  if (p.grouped_out) {
    apply_gates(p, rows);
    zero_dropped_rows(p, rows);
    return rows;
  }
  return in_slot_order(p, rows, p.slot_of_assignment);  // assignment a gets slot_of_assignment[a]'s row
}

// grad_x, grad_weight and grad_gates on the sm_90a GEMMs (the LoRA factor gradients stay with the
// caller: rank-r products); v = scaling dy_s B_e or undefined.
void grouped_linear_backward_sm90(const Problem& p, const at::Tensor& dy, const at::Tensor& v, bool compute_grad_x,
                                  bool compute_grad_weight, bool compute_grad_gates, at::Tensor& grad_x,
                                  at::Tensor& grad_weight, at::Tensor& grad_gates) {
  const Sizes& z = p.size;
  const at::Tensor dy_map = p.grouped_out ? at::Tensor() : p.summed() ? p.token_of_slot : p.sorted_token_idx;
  // dy's rows by token in grad_x's GEMM itself (PYKERNELS_SM90_MOE_GATHER=mainloop) where that GEMM is
  // the only reader of them in slot order: no weight gradient, the weight stored [E, out, in].
  const bool gather = dy_map.defined() && !compute_grad_weight && !p.weight_n_major && gather_in_mainloop();
  const at::Tensor dys = gather ? dy : in_slot_order(p, dy, dy_map);
  if (compute_grad_x || compute_grad_gates) {
    at::Tensor dx_rows = at::empty({z.slots, z.in}, p.x.options());  // dy_s W_e + v_s A_e, ungated
    // With LoRA, v A_e is extra K of the same GEMM (K = r8 as in the forward: A_e padded with zero
    // rows), laid out like the weight.
    at::Tensor a;
    std::optional<ExtraK> lora_term;
    if (v.defined()) {
      const int64_t r8 = p.padded_rank();
      a = at::zeros({z.experts, r8, z.in}, p.x.options());
      a.narrow(1, 0, z.rank).copy_(p.lora_a_by_expert());
      if (p.weight_n_major) a = a.transpose(1, 2).contiguous();  // [E, in, r8]: K-major like W_e
      lora_term = ExtraK{&v, r8, &a, p.weight_n_major ? r8 : z.in, r8 * z.in};
    }
    if (p.weight_n_major) {  // W_e = the stored [in, out] matrix transposed: B [n, k]
      sm90_rows(p, Sm90GemmKind::kRowsKMajorB, dys, z.out, p.weight, z.out, z.out * z.in, dx_rows, false, lora_term);
    } else {
      sm90_rows(p, Sm90GemmKind::kRowsNMajorB, dys, z.out, p.weight, z.in, z.out * z.in, dx_rows, false, lora_term,
                gather ? dy_map : at::Tensor());
    }
    if (compute_grad_gates) {
      at::Tensor dots = at::empty({1, z.slots}, p.x.options().dtype(at::kFloat));
      RowDotsParams d{dtype_of(dx_rows), z.slots, slot_rows(dx_rows), p.x_rows(), dots.data_ptr<float>()};
      check_launch(launch_row_dots(d, p.stream));
      grad_gates = at::empty({z.tokens, z.top_k}, p.gates.options());
      GateGradParams gg{dots.data_ptr<float>(), 1, z.slots, p.slot_of_assignment.data_ptr<int64_t>(),
                        grad_gates.data_ptr(), dtype_of(grad_gates)};
      check_launch(launch_gate_grad(gg, p.stream));
    }
    if (compute_grad_x && p.grouped_in) {
      apply_gates(p, dx_rows);
      zero_dropped_rows(p, dx_rows);
      grad_x = dx_rows;
    } else if (compute_grad_x) {
      grad_x = sum_per_token(p, dx_rows, /*gated=*/true);  // gates applied in the sum
    }
  }
  if (compute_grad_weight) {
    at::Tensor gated_dy = dys;
    if (p.gates.defined()) {
      if (dys.is_same(dy)) gated_dy = dys.clone();  // the caller's gradient: never scaled in place
      apply_gates(p, gated_dy);
    }
    const at::Tensor xs = in_slot_order(p, p.x, p.grouped_in ? at::Tensor() : p.token_of_slot);
    const at::Tensor zeros = at::zeros({std::max(z.out, z.in)}, p.x.options());
    grad_weight = at::empty(p.weight.sizes(), p.weight.options());
    GroupedGemmSm90Params g = sm90_gemm(p, Sm90GemmKind::kWeightGrad);
    g.m = z.out;
    g.n = z.in;
    g.a = gated_dy.data_ptr();
    g.lda = z.out;
    g.b = xs.data_ptr();
    g.ldb = z.in;
    g.d = grad_weight.data_ptr();
    g.ldd = z.in;
    g.d_expert_stride = z.out * z.in;
    g.zeros = zeros.data_ptr();
    run_sm90(p, g);
  }
}

// ------------------------------------------------------------------ ops
std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_tokens_cuda(const at::Tensor& top_k_index, int64_t num_experts) {
  check_top_k_index(top_k_index, num_experts);
  const c10::cuda::CUDAGuard guard(top_k_index.device());
  const at::Tensor ids = top_k_index.contiguous();
  const auto long_options = ids.options().dtype(at::kLong);
  at::Tensor sorted_expert = at::empty({ids.numel()}, long_options);
  at::Tensor sorted_token = at::empty({ids.numel()}, long_options);
  at::Tensor offsets = at::empty({num_experts + 1}, long_options);
  SortParams s{ids.data_ptr(), ids.scalar_type() == at::kLong, ids.numel(), num_experts,
               sorted_expert.data_ptr<int64_t>(), sorted_token.data_ptr<int64_t>(), offsets.data_ptr<int64_t>()};
  const at::Tensor workspace = at::empty({sort_workspace_bytes(s)}, ids.options().dtype(at::kByte));
  check_launch(launch_sort_tokens(s, workspace.data_ptr(), current_stream(ids)));
  return {sorted_expert, sorted_token, offsets};
}

at::Tensor grouped_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                               const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                               bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                               const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                               double lora_scaling) {
  const Sizes sizes = check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                           grouped_in, gates, lora_a, lora_b);
  const c10::cuda::CUDAGuard guard(x.device());
  const Problem p = make_problem(sizes, x, weight, sorted_token_idx, expert_offsets, grouped_in, grouped_out, gates,
                                 lora_a, lora_b, lora_scaling);
  if (use_sm90(p, {p.x, p.weight, p.lora_a, p.lora_b})) return grouped_linear_sm90(p);
  const Sizes& z = p.size;
  // Slot rows land in y (slot or assignment order) or, summed per token, in a slot-order workspace.
  at::Tensor rows = at::empty({z.slots, z.out}, p.x.options());
  GroupedRowsParams g = rows_gemm(p, z.out);
  g.a = p.x_rows();
  const at::Tensor weight_k_major = p.k_major_weight();
  g.b = k_major(weight_k_major);
  at::Tensor u, b_by_expert;
  if (p.lora()) {
    u = lora_u(p);
    b_by_expert = lora_b_by_expert(p);
    g.a2 = slot_rows(u);
    g.b2 = k_major(b_by_expert);
  }
  if (p.gates.defined()) g.gate_of_slot = p.gate_of_slot.data_ptr<float>();
  g.out = rows.data_ptr();
  g.ld_out = z.out;
  g.out_map = p.summed() || p.grouped_out ? nullptr : p.sorted_token_idx.data_ptr<int64_t>();
  run_rows_gemm(g, p);
  return p.summed() ? sum_per_token(p, rows) : rows;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> grouped_linear_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
    const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in,
    bool grouped_out, const std::optional<at::Tensor>& gates, const std::optional<at::Tensor>& lora_a,
    const std::optional<at::Tensor>& lora_b, double lora_scaling, bool compute_grad_x, bool compute_grad_weight,
    bool compute_grad_gates, bool compute_grad_lora) {
  const Sizes sizes = check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                           grouped_in, gates, lora_a, lora_b);
  const int64_t grad_rows = gates.has_value() && !grouped_out ? sizes.tokens : sizes.slots;
  TORCH_CHECK_VALUE(grad_y.dim() == 2 && grad_y.size(0) == grad_rows && grad_y.size(1) == sizes.out,
                    "grad_y must have shape (", grad_rows, ", ", sizes.out, "), got ",
                    shape_string(grad_y.sizes()));
  TORCH_CHECK_VALUE(grad_y.device() == x.device(), "grad_y must be on x's device ", x.device(), ", got ",
                    grad_y.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const Problem p = make_problem(sizes, x, weight, sorted_token_idx, expert_offsets, grouped_in, grouped_out, gates,
                                 lora_a, lora_b, lora_scaling);
  const Sizes& z = p.size;
  compute_grad_gates = compute_grad_gates && p.gates.defined();
  compute_grad_lora = compute_grad_lora && p.lora();
  const at::Tensor dy = grad_y.to(x.scalar_type()).contiguous();
  // The row of dy each slot reads: its own, its token's (summed output) or its assignment's.
  const SlotRows dy_rows =
      slot_rows(dy, grouped_out ? at::Tensor() : p.summed() ? p.token_of_slot : p.sorted_token_idx);
  auto empty = [](const at::Tensor& like) { return at::empty({0}, like.options()); };
  at::Tensor grad_x = empty(x), grad_weight = empty(weight), grad_gates = empty(x);
  at::Tensor grad_a = empty(x), grad_b = empty(x);

  at::Tensor v;
  if (p.lora() && (compute_grad_x || compute_grad_gates || compute_grad_lora)) {
    const at::Tensor b_by_expert = lora_b_by_expert(p);
    v = at::empty({z.slots, p.padded_rank()}, p.x.options());  // scaling dy_s B_e (padding: zero columns of B)
    GroupedRowsParams g = rows_gemm(p, p.padded_rank());
    g.a = dy_rows;
    g.b = n_major(b_by_expert, z.out);
    g.alpha = p.scaling;
    g.out = v.data_ptr();
    g.ld_out = v.size(1);
    run_rows_gemm(g, p);
  }
  const bool sm90 = use_sm90(p, {p.x, p.weight, p.lora_a, p.lora_b, dy});
  if (sm90) {
    grouped_linear_backward_sm90(p, dy, v, compute_grad_x, compute_grad_weight, compute_grad_gates, grad_x,
                                 grad_weight, grad_gates);
  } else if (compute_grad_x || compute_grad_gates) {
    GroupedRowsParams g = rows_gemm(p, z.in);
    g.a = dy_rows;
    const at::Tensor weight_k_major = p.k_major_weight();
    g.b = n_major(weight_k_major, z.out);
    if (p.lora()) {
      g.a2 = slot_rows(v);
      g.b2 = n_major(p.lora_a_by_expert(), z.rank);
    }
    if (p.gates.defined()) g.gate_of_slot = p.gate_of_slot.data_ptr<float>();
    at::Tensor dx_rows, partial;  // dx in slot order; per column tile gate-gradient dots
    if (compute_grad_x) {
      dx_rows = at::empty({z.slots, z.in}, p.x.options());
      g.out = dx_rows.data_ptr();
      g.ld_out = z.in;
    }
    if (compute_grad_gates) {
      partial = at::empty({grouped_rows_column_tiles(g), z.slots}, p.x.options().dtype(at::kFloat));
      g.dgate_partial = partial.data_ptr<float>();
      g.dot_rows = p.x_rows();
    }
    run_rows_gemm(g, p);
    if (compute_grad_x) grad_x = grouped_in ? dx_rows : sum_per_token(p, dx_rows);
    if (compute_grad_gates) {
      grad_gates = at::empty({z.tokens, z.top_k}, p.gates.options());
      GateGradParams gg{partial.data_ptr<float>(), partial.size(0), z.slots, p.slot_of_assignment.data_ptr<int64_t>(),
                        grad_gates.data_ptr(), dtype_of(grad_gates)};
      check_launch(launch_gate_grad(gg, p.stream));
    }
  }
  if (compute_grad_weight && !sm90) {
    at::Tensor gated_dy_storage;
    grad_weight = at::empty(p.weight.sizes(), p.weight.options());
    weight_grad_gemm(p, gated(p, dy_rows, gated_dy_storage), p.x_rows(), z.out, z.in, grad_weight, z.out * z.in,
                     z.in, 1);  // dW_e = sum g_s dy_s^T x_s
  }
  if (compute_grad_lora) {
    // The gate rides on the rank-r operand of each product (g_s u_s, g_s v_s: r8 columns), not on dy:
    // a gated copy of dy would be [slots, out] (512 MiB at Qwen3-30B-A3B's down projection, T 16384),
    // written and read again for the same sums.
    at::Tensor gated_u_storage, gated_v_storage;
    const at::Tensor u = lora_u(p);
    grad_b = at::empty(p.lora_b.sizes(), p.lora_b.options());  // dB_e = columns e, e + E, ...
    weight_grad_gemm(p, dy_rows, gated(p, slot_rows(u), gated_u_storage), z.out, z.rank, grad_b, 1,
                     z.rank * z.experts, z.experts);
    grad_a = at::empty(p.lora_a.sizes(), p.lora_a.options());  // dA_e = rows e r .. e r + r - 1
    weight_grad_gemm(p, gated(p, slot_rows(v), gated_v_storage), p.x_rows(), z.rank, z.in, grad_a,
                     z.rank * z.in, z.in, 1);
  }
  return {grad_x, grad_weight, grad_gates, grad_a, grad_b};
}

// The gated gate_up GEMM on the sm_90a core (common/paired_rows.h): one GEMM writes the paired
// pre-activation and act(gate) * up (moe/gate_up_act.h); the experts' LoRA rides as extra K, B_e's
// rows paired like the weight's. Nothing when the problem cannot take it: the caller composes.
std::optional<std::tuple<at::Tensor, at::Tensor>> gate_up_act_sm90(const Problem& p, const GatedActSpec& spec) {
  const Sizes& z = p.size;
  if (p.weight_n_major || !use_sm90(p, {p.x, p.weight, p.lora_a, p.lora_b}) || (p.lora() && !lora_as_extra_k()))
    return std::nullopt;
  GroupedGemmSm90Params g = sm90_gemm(p, Sm90GemmKind::kRowsKMajorB);
  g.n = z.out;
  g.k = z.in;
  g.ldb = z.in;
  g.b_expert_stride = z.out * z.in;
  // The rule's tile, or 128x128 where the rule's holds no whole pairs of halves (n / 2 not a multiple of 128).
  auto fits = [&](gemm::Sm90Tile tile) {
    return gemm::paired_rows_error(z.out, z.in, z.in, 2, gemm::sm90_tile_columns(tile), gemm::kSm90TileK,
                                   gemm::sm90_tile_cluster_m(tile)) == nullptr;
  };
  g.tile = gemm::sm90_tile_of(g);
  if (!fits(g.tile)) g.tile = gemm::Sm90Tile::k128x128;
  if (!fits(g.tile)) return std::nullopt;
  // x's rows by token: gathered by the GEMM (PYKERNELS_SM90_MOE_GATHER=mainloop) or by a pass first
  const bool gather = !p.grouped_in && gather_in_mainloop();
  const at::Tensor xs = p.grouped_in || gather ? p.x : in_slot_order(p, p.x, p.token_of_slot);
  if (gather) g.a_rows = p.token_of_slot.data_ptr<int64_t>();
  at::Tensor rows = at::empty({z.slots, z.out}, p.x.options());
  at::Tensor inner = at::empty({z.slots, z.out / 2}, p.x.options());
  at::Tensor u, b;
  if (p.lora()) {
    const int64_t r8 = p.padded_rank();
    u = lora_u(p);
    b = lora_b_by_expert(p).view({z.experts, 2, z.out / 2, r8}).transpose(1, 2).reshape({z.experts, z.out, r8});
    g.a2 = u.data_ptr();
    g.lda2 = r8;
    g.k2 = r8;
    g.b2 = b.data_ptr();
    g.ldb2 = r8;
    g.b2_expert_stride = z.out * r8;
  }
  g.a = xs.data_ptr();
  g.lda = z.in;
  g.b = p.weight.data_ptr();
  g.d = rows.data_ptr();
  g.ldd = z.out;
  g.act_out = inner.data_ptr();
  g.act_spec = spec;
  gemm::run_grouped_gemm_sm90(g, static_cast<int>(p.x.get_device()), p.stream, /*keep_tile=*/true);
  zero_dropped_rows(p, rows);
  zero_dropped_rows(p, inner);
  return std::make_tuple(inner, rows);
}

std::tuple<at::Tensor, at::Tensor> gate_up_act_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                    const at::Tensor& sorted_expert_idx,
                                                    const at::Tensor& sorted_token_idx,
                                                    const at::Tensor& expert_offsets, int64_t top_k, bool grouped_in,
                                                    const std::optional<at::Tensor>& lora_a,
                                                    const std::optional<at::Tensor>& lora_b, double lora_scaling,
                                                    int64_t act, double alpha, double limit) {
  check_gate_up_weight(weight);
  TORCH_CHECK_VALUE(act >= 0 && act < kGatedActCount, "moe_gate_up_act: act must be in [0, ", kGatedActCount,
                    "), got ", act);
  const Sizes sizes = check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                           grouped_in, std::nullopt, lora_a, lora_b);
  {
    const c10::cuda::CUDAGuard guard(x.device());
    const Problem p = make_problem(sizes, x, weight, sorted_token_idx, expert_offsets, grouped_in,
                                   /*grouped_out=*/true, std::nullopt, lora_a, lora_b, lora_scaling);
    const GatedActSpec spec{static_cast<GatedAct>(act), static_cast<float>(alpha), static_cast<float>(limit)};
    if (auto fused = gate_up_act_sm90(p, spec)) return *fused;
  }
  return gate_up_act_composed(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                              lora_a, lora_b, lora_scaling, act, alpha, limit);
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("moe_sort_tokens", &sort_tokens_cuda);
  m.impl("moe_gate_up_act", &gate_up_act_cuda);
  m.impl("moe_grouped_linear", &grouped_linear_cuda);
  m.impl("moe_grouped_linear_backward", &grouped_linear_backward_cuda);
}

}  // namespace pykernels::moe
