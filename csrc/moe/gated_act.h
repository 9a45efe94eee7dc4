// The expert MLP's gated activation as one pass (op moe_gated_act and its backward; CPU in
// gated_act_cpu.cpp, CUDA in moe_routing.cu): inner = act(gate) * up from the gate_up projection
// [rows, 2I], gate and up the first and last I columns (transformers' layout) or alternate columns
// (interleaved: GPT-OSS). Torch eager runs it as 2 kernels forward (act, then the product, with an
// [rows, I] temporary) and ~6 backward; here each direction reads its inputs once and writes its
// outputs once, in fp32 with one rounding per output. At Mixtral's experts (I 14336, T 4096, top 2)
// that is 1.9 GB of traffic per forward+backward instead of ~4 GB.
//
// The formulas (pykernels.moe_types: ACTIVATIONS, ClampedSwiGLU), with their derivatives:
//   silu        a = g s, s = sigmoid(g)                 a' = s (1 + g (1 - s))
//   gelu        a = g Phi(g) (erf)                      a' = Phi(g) + g phi(g)
//   gelu_tanh   a = g (1 + t) / 2, t = tanh(k (g + c g^3))
//                                                       a' = (1 + t) / 2 + g (1 - t^2) k (1 + 3 c g^2) / 2
//   relu        a = max(g, 0)                           a' = [g > 0]
//   clamped_swiglu (GPT-OSS)  gc = min(g, L), uc = clamp(up, -L, L):
//               inner = (uc + 1) gc sigmoid(alpha gc); the clamps pass gradient where torch's
//               clamp does (g <= L; -L <= up <= L)
// NaN stays NaN through the clamps and relu, as in torch. Torch- and CUDA-free: the CPU and CUDA
// kernels and the host tests share these functions.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dtype.h"
#include "common/host_device.h"

typedef struct CUstream_st* cudaStream_t;

namespace pykernels::moe {

// The op's `act` argument (pykernels/ops/moe.py keeps the same numbering).
enum class GatedAct : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kClampedSwiglu = 4 };
inline constexpr int64_t kGatedActCount = 5;

struct GatedActSpec {
  GatedAct act;
  float alpha;  // clamped_swiglu only
  float limit;
};

struct GatedActGrad {
  float gate, up;
};

PYKERNELS_HOST_DEVICE inline float sigmoid_of(float x) { return 1.0f / (1.0f + expf(-x)); }

// Clamp that keeps NaN (torch.clamp does; fminf would return the bound).
PYKERNELS_HOST_DEVICE inline float clamp_keep_nan(float x, float lo, float hi) { return x < lo ? lo : x > hi ? hi : x; }

inline constexpr float kGeluTanhK = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluTanhC = 0.044715f;
inline constexpr float kInvSqrt2 = 0.7071067811865476f;
inline constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// act(g) and act'(g) for the ungated activations.
PYKERNELS_HOST_DEVICE inline float activation(GatedAct act, float g) {
  switch (act) {
    case GatedAct::kGelu: return 0.5f * g * (1.0f + erff(g * kInvSqrt2));
    case GatedAct::kGeluTanh: return 0.5f * g * (1.0f + tanhf(kGeluTanhK * (g + kGeluTanhC * g * g * g)));
    case GatedAct::kRelu: return g < 0.0f ? 0.0f : g;
    default: return g * sigmoid_of(g);  // silu
  }
}

PYKERNELS_HOST_DEVICE inline float activation_derivative(GatedAct act, float g) {
  switch (act) {
    case GatedAct::kGelu: return 0.5f * (1.0f + erff(g * kInvSqrt2)) + g * kInvSqrt2Pi * expf(-0.5f * g * g);
    case GatedAct::kGeluTanh: {
      const float t = tanhf(kGeluTanhK * (g + kGeluTanhC * g * g * g));
      return 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kGeluTanhK * (1.0f + 3.0f * kGeluTanhC * g * g);
    }
    case GatedAct::kRelu: return g > 0.0f ? 1.0f : 0.0f;
    default: {  // silu
      const float s = sigmoid_of(g);
      return s * (1.0f + g * (1.0f - s));
    }
  }
}

PYKERNELS_HOST_DEVICE inline float gated_act(const GatedActSpec& spec, float gate, float up) {
  if (spec.act == GatedAct::kClampedSwiglu) {
    const float g = gate > spec.limit ? spec.limit : gate;
    const float u = clamp_keep_nan(up, -spec.limit, spec.limit);
    return (u + 1.0f) * (g * sigmoid_of(spec.alpha * g));
  }
  return activation(spec.act, gate) * up;
}

// d inner / d gate and d inner / d up, times grad (the gradient of inner).
PYKERNELS_HOST_DEVICE inline GatedActGrad gated_act_grad(const GatedActSpec& spec, float gate, float up, float grad) {
  if (spec.act == GatedAct::kClampedSwiglu) {
    const float g = gate > spec.limit ? spec.limit : gate;
    const float u = clamp_keep_nan(up, -spec.limit, spec.limit);
    const float s = sigmoid_of(spec.alpha * g);
    const bool gate_passes = gate <= spec.limit, up_passes = up >= -spec.limit && up <= spec.limit;
    return {gate_passes ? grad * (u + 1.0f) * (s + spec.alpha * g * s * (1.0f - s)) : 0.0f,
            up_passes ? grad * g * s : 0.0f};
  }
  return {grad * up * activation_derivative(spec.act, gate), grad * activation(spec.act, gate)};
}

// Where gate j and up j of a row of the gate_up projection [rows, 2 inner] sit.
PYKERNELS_HOST_DEVICE inline int64_t gate_column(int64_t j, int64_t inner, bool interleaved) {
  return interleaved ? 2 * j : j;
}
PYKERNELS_HOST_DEVICE inline int64_t up_column(int64_t j, int64_t inner, bool interleaved) {
  return interleaved ? 2 * j + 1 : inner + j;
}

// The CUDA launcher (moe_routing.cu): forward when grad_inner is null (inner = act(gate) * up),
// else the backward (grad_gate_up [rows, 2 inner] from grad_inner [rows, inner], in gate_up's layout
// or, with grad_interleaved != interleaved, in the other). All contiguous.
struct GatedActParams {
  DType dtype;  // of every tensor
  GatedActSpec spec;
  bool interleaved;
  int64_t rows, inner;
  const void* gate_up;     // [rows, 2 inner]
  const void* grad_inner;  // backward: [rows, inner]
  void* out;               // forward: inner [rows, inner]; backward: grad_gate_up [rows, 2 inner]
  bool grad_interleaved;   // backward: grad_gate_up's layout
};
const char* launch_gated_act(const GatedActParams& p, cudaStream_t stream);

}  // namespace pykernels::moe
