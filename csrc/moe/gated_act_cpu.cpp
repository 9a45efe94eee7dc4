// CPU implementation of the gated activation ops (the math and why: moe/gated_act.h): rows split
// over threads, each element computed in fp32 from its gate and up and rounded once. bf16 SwiGLU
// in transformers' layout takes the AVX2 or AVX-512 kernels (gated_act_cpu_kernels.h) where the CPU
// has them; everything else the scalar formulas.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "moe/gated_act.h"
#include "moe/gated_act_cpu_kernels.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

constexpr int64_t kGrainElements = 32768;  // per thread task: ~30 us of exp work

GatedActSpec spec_of(int64_t act, double alpha, double limit) {
  return {static_cast<GatedAct>(act), static_cast<float>(alpha), static_cast<float>(limit)};
}

int64_t grain_rows(int64_t inner) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inner, 1)); }

bool vector_silu(const at::Tensor& gate_up, int64_t act, bool interleaved) {
  return act == static_cast<int64_t>(GatedAct::kSilu) && !interleaved && gate_up.scalar_type() == at::kBFloat16 &&
         cpu::has_silu_gated_bf16();
}

const uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bf16_bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

at::Tensor gated_act_cpu(const at::Tensor& gate_up, int64_t act, bool interleaved, double alpha, double limit) {
  const int64_t inner = check_gated_act(gate_up, act, kGatedActCount), rows = gate_up.size(0);
  const GatedActSpec spec = spec_of(act, alpha, limit);
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  if (vector_silu(gate_up, act, interleaved)) {
    at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      cpu::silu_gated_bf16(bf16_bits(gate_up), begin, end, inner, bf16_bits(out));
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "moe_gated_act", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * 2 * inner;
        for (int64_t j = 0; j < inner; ++j) {
          const float gate = static_cast<float>(row[gate_column(j, inner, interleaved)]);
          const float up = static_cast<float>(row[up_column(j, inner, interleaved)]);
          y[r * inner + j] = static_cast<scalar_t>(gated_act(spec, gate, up));
        }
      }
    });
  });
  return out;
}

at::Tensor gated_act_backward_cpu(const at::Tensor& grad_inner, const at::Tensor& gate_up, int64_t act,
                                  bool interleaved, double alpha, double limit, std::optional<bool> grad_interleaved) {
  const int64_t inner = check_gated_act(gate_up, act, kGatedActCount), rows = gate_up.size(0);
  check_gated_act_grad(grad_inner, gate_up);
  const GatedActSpec spec = spec_of(act, alpha, limit);
  const bool out_interleaved = grad_interleaved.value_or(interleaved);
  at::Tensor grad_gate_up = at::empty_like(gate_up);
  if (out_interleaved == interleaved && vector_silu(gate_up, act, interleaved)) {
    at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      cpu::silu_gated_backward_bf16(bf16_bits(gate_up), bf16_bits(grad_inner), begin, end, inner,
                                    bf16_bits(grad_gate_up));
    });
    return grad_gate_up;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "moe_gated_act_backward", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    const scalar_t* dy = grad_inner.data_ptr<scalar_t>();
    scalar_t* dx = grad_gate_up.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * 2 * inner;
        scalar_t* grad_row = dx + r * 2 * inner;
        for (int64_t j = 0; j < inner; ++j) {
          const int64_t g = gate_column(j, inner, interleaved), u = up_column(j, inner, interleaved);
          const GatedActGrad d = gated_act_grad(spec, static_cast<float>(row[g]), static_cast<float>(row[u]),
                                                static_cast<float>(dy[r * inner + j]));
          grad_row[gate_column(j, inner, out_interleaved)] = static_cast<scalar_t>(d.gate);
          grad_row[up_column(j, inner, out_interleaved)] = static_cast<scalar_t>(d.up);
        }
      }
    });
  });
  return grad_gate_up;
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("moe_gated_act", &gated_act_cpu);
  m.impl("moe_gated_act_backward", &gated_act_backward_cpu);
}

}  // namespace pykernels::moe
