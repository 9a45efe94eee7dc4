// Every op schema of pykernels, one comment line per op. Implementations register per dispatch
// key in the file that defines them (<family>_cpu.cpp, <family>_cuda_torch.cpp); fake
// (meta) implementations for torch.compile live in pykernels/ops/<family>.py. Autograd: in C++
// for the ops a model calls per layer (<family>_autograd.cpp: LoRA, MoE; no Python between forward
// and backward), through torch.library.register_autograd for token_logprobs (once per step).
#include <torch/library.h>

TORCH_LIBRARY(pykernels, m) {
  // ---- NF4 (bitsandbytes-compatible 4-bit NormalFloat, QLoRA https://arxiv.org/abs/2305.14314)

  // Quantizes x (any shape, fp32/fp16/bf16) in blocks: packed uint8 [ceil(numel/2)] (two codes per
  // byte, high nibble first) and absmax fp32 [ceil(numel/blocksize)].
  m.def("nf4_quantize(Tensor x, int blocksize) -> (Tensor packed, Tensor absmax)");

  // code[nibble] * absmax[block] rounded to dtype, reshaped to shape; absmax is fp32, or uint8
  // codes when nested_absmax/code/offset are given (double quantization, nested blocks of 256).
  m.def(
      "nf4_dequantize(Tensor packed, Tensor absmax, int blocksize, SymInt[] shape, ScalarType dtype, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> Tensor");

  // The same written into out (contiguous, on packed's device; its dtype and numel are the output's):
  // a caller that dequantizes each step reuses one buffer instead of faulting in fresh pages.
  m.def(
      "nf4_dequantize_into(Tensor packed, Tensor absmax, int blocksize, Tensor(a!) out, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> ()");

  // bitsandbytes' 8-bit blockwise quantization of fp32 (x - offset) with a 256-entry code (double
  // quantization of absmax): q uint8 [numel], absmax fp32 [ceil(numel/blocksize)].
  // https://arxiv.org/abs/1511.04561
  m.def(
      "dynamic8_quantize(Tensor x, Tensor code, int blocksize, Tensor? offset=None) -> (Tensor q, Tensor absmax)");

  // code[q] * absmax[block] as fp32 [numel].
  m.def("dynamic8_dequantize(Tensor q, Tensor absmax, Tensor code, int blocksize) -> Tensor");

  // ---- Fused LoRA linear (Hu et al. 2021, https://arxiv.org/abs/2106.09685); x [M, K], weight [N, K],
  //      lora_A [r, K], lora_B [N, r]; x_lora (LoRA's input after dropout) defaults to x.

  // y = x W^T + bias + scaling * (x_lora A^T) B^T in x's dtype, and xa = x_lora A^T accumulated
  // and kept in fp32 [M, r] (saved for backward).
  m.def(
      "lora_linear(Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, float scaling, Tensor? bias=None, "
      "Tensor? x_lora=None) -> (Tensor y, Tensor xa)");

  // The same with an NF4 weight [out_features, K] dequantized a chunk of rows at a time inside
  // (never materialized in full); absmax as in nf4_dequantize.
  m.def(
      "lora_linear_nf4(Tensor x, Tensor packed, Tensor absmax, int blocksize, SymInt out_features, "
      "Tensor lora_A, Tensor lora_B, float scaling, Tensor? bias=None, Tensor? x_lora=None, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> (Tensor y, Tensor xa)");

  // Gradients of lora_linear: grad_x = dy W (+ dxa A when x_lora is absent, fused into that GEMM),
  // grad_x_lora = dxa A (empty when x_lora is absent), grad_A, grad_B, with dxa = scaling dy B in
  // fp32. grad_x is empty when compute_grad_x is false.
  m.def(
      "lora_linear_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor lora_A, Tensor lora_B, Tensor xa, "
      "float scaling, Tensor? x_lora=None, bool compute_grad_x=True) "
      "-> (Tensor grad_x, Tensor grad_x_lora, Tensor grad_A, Tensor grad_B)");

  // Gradients of lora_linear_nf4 (the NF4 weight dequantized a chunk of rows at a time).
  m.def(
      "lora_linear_nf4_backward(Tensor grad_y, Tensor x, Tensor packed, Tensor absmax, int blocksize, "
      "Tensor lora_A, Tensor lora_B, Tensor xa, float scaling, Tensor? x_lora=None, bool compute_grad_x=True, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> (Tensor grad_x, Tensor grad_x_lora, Tensor grad_A, Tensor grad_B)");

  // ---- Per-token logprobs with the lm_head fused in: hidden [N, H], weight [V, H] (one float dtype),
  //      targets int64 [N]; logits z = hidden weight^T / temperature exist one tile at a time.

  // logprobs = z[target] - logsumexp(z) and entropy = -sum softmax(z) log softmax(z), fp32 [N] (0 where
  // target == ignore_index), lse = logsumexp(z) fp32 [N] (saved for backward), and with
  // hidden_grad_terms = 1 / 2 the gradients of logprobs (and entropy) with respect to hidden, fp32
  // [terms, N, H], computed in the same pass (for a frozen weight; empty where a kernel lacks it).
  m.def(
      "token_logprobs(Tensor hidden, Tensor weight, Tensor targets, float temperature=1.0, int ignore_index=-100, "
      "int hidden_grad_terms=0) -> (Tensor logprobs, Tensor entropy, Tensor lse, Tensor grad_terms)");

  // Gradients of token_logprobs for incoming grad_logprobs (and grad_entropy) [N]: grad_hidden
  // [N, H] and grad_weight [V, H] (summed in fp32, rounded once), each empty when not asked for.
  m.def(
      "token_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor targets, Tensor lse, Tensor entropy, float temperature=1.0, int ignore_index=-100, "
      "bool compute_grad_hidden=True, bool compute_grad_weight=True) -> (Tensor grad_hidden, Tensor grad_weight)");

  // ---- Grouped MoE GEMM (scatter2scatter, ScatterMoE https://arxiv.org/abs/2403.08245): top_k_index
  //      [T, k] expert ids; assignment a = t * k + j; expert weights [E, out, in] (transformers 5
  //      layout); LoRA on experts in PEFT's target_parameters layout, lora_a [r*E, in] expert-major,
  //      lora_b [out, r*E] expert-minor (see pykernels/reference/moe.py).

  // Assignments ordered by expert, stable: sorted_expert_idx [T*k] (E for ids outside [0, E), sorted
  // last), sorted_token_idx [T*k] (the assignment in each slot), expert_offsets [E + 1]; all int64.
  m.def(
      "moe_sort_tokens(Tensor top_k_index, int num_experts) -> (Tensor sorted_expert_idx, "
      "Tensor sorted_token_idx, Tensor expert_offsets)");

  // y_s = x_s W_e^T (+ lora_scaling (x_s A_e^T) B_e^T) (* gates[a]) per slot s of expert e. x [T, in]
  // gathered by token, or [T*k, in] in slot order (grouped_in); output [T*k, out] in slot order
  // (grouped_out), in assignment order, or [T, out] summed over each token's slots (gates given and
  // not grouped_out). fp32 accumulation, x's dtype out.
  m.def(
      "moe_grouped_linear(Tensor x, Tensor weight, Tensor sorted_expert_idx, Tensor sorted_token_idx, "
      "Tensor expert_offsets, int top_k, bool grouped_in, bool grouped_out, Tensor? gates=None, "
      "Tensor? lora_a=None, Tensor? lora_b=None, float lora_scaling=1.0) -> Tensor");

  // The expert MLP's gated activation in one pass (moe/gated_act.h): inner [rows, I] = act(gate) * up
  // from gate_up [rows, 2I] (gate, up: the first and last I columns, or alternate columns when
  // interleaved); act 0 silu, 1 gelu, 2 gelu_tanh, 3 relu, 4 clamped_swiglu (alpha, limit: GPT-OSS).
  // fp32 math, one rounding. The backward gives grad_gate_up [rows, 2I] in the same layout, or in the
  // other one when grad_interleaved says so (moe_gate_up_act's backward: paired in, the weight's out).
  m.def("moe_gated_act(Tensor gate_up, int act, bool interleaved, float alpha, float limit) -> Tensor");
  m.def(
      "moe_gated_act_backward(Tensor grad_inner, Tensor gate_up, int act, bool interleaved, float alpha, "
      "float limit, bool? grad_interleaved=None) -> Tensor");

  // The gate_up projection and the gated activation as one op (moe/gate_up_act.h): the slot-order
  // rows of moe_grouped_linear(x, weight, ..., grouped_out=True) (weight [E, 2I, in], gate rows then
  // up rows) and act(gate) * up from them. Returns (inner [slots, I], gate_up [slots, 2I] with gate_j,
  // up_j in columns 2j, 2j + 1: the pre-activation the backward reads). On Hopper one GEMM writes both.
  m.def(
      "moe_gate_up_act(Tensor x, Tensor weight, Tensor sorted_expert_idx, Tensor sorted_token_idx, "
      "Tensor expert_offsets, int top_k, bool grouped_in, Tensor? lora_a, Tensor? lora_b, float lora_scaling, "
      "int act, float alpha, float limit) -> (Tensor, Tensor)");

  // Gradients of moe_grouped_linear: grad_x, grad_weight [E, out, in], grad_gates [T, k], grad_lora_a,
  // grad_lora_b (fp32 sums, rounded once), each empty when its compute flag is false.
  m.def(
      "moe_grouped_linear_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor sorted_expert_idx, "
      "Tensor sorted_token_idx, Tensor expert_offsets, int top_k, bool grouped_in, bool grouped_out, "
      "Tensor? gates, Tensor? lora_a, Tensor? lora_b, float lora_scaling, bool compute_grad_x, "
      "bool compute_grad_weight, bool compute_grad_gates, bool compute_grad_lora) -> (Tensor grad_x, "
      "Tensor grad_weight, Tensor grad_gates, Tensor grad_lora_a, Tensor grad_lora_b)");
}
