// The CPU grouped linear's shared pieces (moe_cpu_grouped_linear.h).
#include "moe/moe_cpu_grouped_linear.h"

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_isa.h"
#include "common/cpu_simd.h"
#include "moe/moe_cpu_kernels.h"

namespace pykernels::moe::cpu_op {
namespace {

at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

Problem make_problem(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& sorted_expert_idx,
                     const at::Tensor& sorted_token_idx, const at::Tensor& expert_offsets, int64_t top_k,
                     bool grouped_in, bool grouped_out, const std::optional<at::Tensor>& gates,
                     const std::optional<at::Tensor>& lora_a, const std::optional<at::Tensor>& lora_b,
                     double scaling) {
  const bool n_major = !weight.is_contiguous() && weight.transpose(1, 2).is_contiguous();
  Problem p{check_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                                 gates, lora_a, lora_b),
            x.contiguous(), n_major ? weight : weight.contiguous(), sorted_token_idx, {}, n_major, lora_a, lora_b,
            scaling, grouped_in, grouped_out, {}, compute_dtype(x)};
  check_routing_values(sorted_token_idx, expert_offsets);
  const int64_t* off = expert_offsets.data_ptr<int64_t>();
  p.offsets.assign(off, off + p.size.experts + 1);
  if (gates) p.gates_flat = gates->reshape(-1).to(p.compute);
  return p;
}

// Rows in slot order [slots, cols] -> the op's layout: slot order, assignment order, or summed per
// token. Dropped slots (past the last expert) hold zeros.
at::Tensor from_slot_order(const at::Tensor& by_slot, const Problem& p, bool grouped, bool sum_per_token) {
  if (grouped) return by_slot;
  at::Tensor by_assignment = at::zeros_like(by_slot).index_copy_(0, p.sorted_token_idx, by_slot);
  if (!sum_per_token) return by_assignment;
  return by_assignment.view({p.size.tokens, p.size.top_k, by_slot.size(1)}).sum(1);
}

bool use_bf16_kernels(const Problem& p) {
  return p.x.scalar_type() == at::kBFloat16 && uses_avx512(active_cpu_isa()) && gemm::has_bf16_gemm();
}

// PEFT's expert-minor LoRA B [out, r * E] (B_e = columns e, e + E, ...) <-> [E, out, r] with B_e
// contiguous. Blocks of kBRows rows of B, expert by expert: each expert's [kBRows, r] slice is
// contiguous on the [E, out, r] side and the block's rows of B (kBRows x r x E) stay in L2, so
// neither side is walked with one element per cache line or one page per element (torch's
// permuted copies of the same took 2-6 ms each at Qwen3-30B-A3B shapes, a tenth of a LoRA
// backward).
constexpr int64_t kBRows = 16;

at::Tensor Problem::lora_b_by_expert() const {
  const int64_t out = size.out, rank = size.rank, experts = size.experts;
  const at::Tensor b = lora_b->contiguous();
  at::Tensor by_expert = at::empty({experts, out, rank}, b.options());
  const uint16_t* src = bf16_data(b);
  uint16_t* dst = reinterpret_cast<uint16_t*>(by_expert.data_ptr());
  at::parallel_for(0, (out + kBRows - 1) / kBRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * kBRows, o1 = std::min(out, b1 * kBRows);
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t q = 0; q < rank; ++q) dst[(e * out + o) * rank + q] = src[(o * rank + q) * experts + e];
      }
    }
  });
  return by_expert;
}

// The gradient of B back in PEFT's layout [out, r * E], rounded once to bf16, from fp32 [E, out, r].
at::Tensor lora_b_grad_from_experts(const at::Tensor& db_t, const Sizes& z) {
  at::Tensor grad = at::empty({z.out, z.rank * z.experts}, db_t.options().dtype(at::kBFloat16));
  const float* src = db_t.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(grad.data_ptr());
  at::parallel_for(0, (z.out + kBRows - 1) / kBRows, 1, [&](int64_t b0, int64_t b1) {
    const int64_t o0 = b0 * kBRows, o1 = std::min(z.out, b1 * kBRows);
    for (int64_t e = 0; e < z.experts; ++e) {
      for (int64_t o = o0; o < o1; ++o) {
        for (int64_t q = 0; q < z.rank; ++q) {
          dst[(o * z.rank + q) * z.experts + e] = round_to_bf16(src[(e * z.out + o) * z.rank + q]);
        }
      }
    }
  });
  return grad;
}

// out [T, cols] bf16 = each token's k slot rows (bf16 [slots, cols] in slot order) summed in
// fp32, in j order; dropped assignments add nothing.
void sum_per_token(const Problem& p, const uint16_t* slot_rows, int64_t cols, at::Tensor& out) {
  const Sizes& z = p.size;
  const int64_t* assignment = p.sorted_token_idx.data_ptr<int64_t>();
  std::vector<int64_t> slot_of(z.slots, -1);
  for (int64_t s = 0; s < p.offsets[z.experts]; ++s) slot_of[assignment[s]] = s;
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, z.tokens, 64, [&](int64_t t0, int64_t t1) {
    cpu::sum_slots_bf16(slot_rows, slot_of.data() + t0 * z.top_k, t1 - t0, z.top_k, cols, dst + t0 * cols);
  });
}

PrepackedChunks::PrepackedChunks(const Problem& p, const uint16_t* rows, int64_t ld, int64_t k,
                                 AlignedVector<uint16_t>& workspace)
    : offset_(p.offsets[p.size.experts], -1) {
  struct Chunk {
    int64_t s0, m;
  };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t e = 0; e < p.size.experts; ++e) {
    for (int64_t s0 = p.offsets[e]; s0 < p.offsets[e + 1]; s0 += kSlotChunk) {
      const int64_t m = std::min(kSlotChunk, p.offsets[e + 1] - s0), size = gemm::prepacked_a_size(m, k);
      if (size == 0) continue;
      offset_[s0] = total;
      total += size;
      chunks.push_back({s0, m});
    }
  }
  if (chunks.empty()) return;
  workspace.resize(total);
  uint16_t* data = workspace.data();
  data_ = data;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      gemm::prepack_a(rows + chunks[i].s0 * ld, ld, chunks[i].m, k, data + offset_[chunks[i].s0]);
    }
  });
}

}  // namespace pykernels::moe::cpu_op
