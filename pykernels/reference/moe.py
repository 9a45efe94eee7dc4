"""Pure-torch grouped MoE ops: the readable statement of pykernels.moe, the test oracle, the
benchmark baseline and the fallback (pykernels.backend.set_kernels("reference")).

Layout (transformers 5 experts): gate_up_proj [E, 2I, H] (the gate's rows first, then up's),
down_proj [E, H, I]; an expert linear with weight [E, out, in] maps a row x [in] routed to expert e
to x @ weight[e].T. Routing: top_k_index [T, k] expert ids, top_k_weights [T, k]; assignment
a = t * k + j is token t's j-th expert. Ids outside [0, E) (another rank's experts under expert
parallelism) are dropped: they contribute nothing and get no gradient.

LoRA on experts uses PEFT's layout for target_parameters (peft/tuners/lora/layer.py, ParamWrapper):
lora_a [r * E, in] expert-major (A_e = lora_a[e * r:(e + 1) * r]), lora_b [out, r * E]
expert-minor (B_e = lora_b[:, e::E]); weight[e] + scaling * B_e @ A_e is what PEFT uses.

Per-expert biases (GPT-OSS): gate_up_bias [E, 2I] is added to each of expert e's gate_up rows,
down_bias [E, H] to its down rows, both before the routing weight.
"""

from __future__ import annotations

import torch

from pykernels.moe_types import Activation, LoRAFactors, gated_activation


def sort_tokens(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Assignments ordered by expert: (sorted_expert_idx [T*k], sorted_token_idx [T*k] (the
    assignment a = t * k + j in each slot), expert_offsets [E + 1]; expert e owns slots
    expert_offsets[e]:expert_offsets[e + 1]). Stable: within an expert, assignment order. Dropped
    ids sort last with sorted_expert_idx = E, past expert_offsets[E]. All int64."""
    flat = top_k_index.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    sorted_expert_idx, sorted_token_idx = torch.sort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    expert_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return sorted_expert_idx, sorted_token_idx, expert_offsets


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idx: torch.Tensor,
                   sorted_token_idx: torch.Tensor, expert_offsets: torch.Tensor, top_k: int,
                   grouped_in: bool = False, grouped_out: bool = False, gates: torch.Tensor | None = None,
                   lora: LoRAFactors | None = None) -> torch.Tensor:
    """Per-slot expert linear (scatter2scatter). Input rows: x [T, in] gathered by token
    (grouped_in=False) or x [T*k, in] already in slot order (grouped_in=True). Each slot's row
    y_s = x_s W_e^T (+ scaling (x_s A_e^T) B_e^T), times gates[t, j] when gates [T, k] is given.
    Output: [T*k, out] in slot order (grouped_out=True), in assignment order (grouped_out=False,
    no gates), or [T, out] summed over each token's k slots (grouped_out=False with gates).
    Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype."""
    num_experts, out_features, _ = weight.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    token = sorted_token_idx // top_k
    rows = (x if grouped_in else x.index_select(0, token)).to(compute)
    offsets = expert_offsets.tolist()
    pieces = []
    for e in range(num_experts):
        xe = rows[offsets[e]:offsets[e + 1]]
        if xe.shape[0] == 0:
            continue
        ye = xe @ weight[e].to(compute).T
        if lora is not None:
            a_e, b_e = lora.expert(e, num_experts)
            ye = ye + lora.scaling * (xe @ a_e.to(compute).T) @ b_e.to(compute).T
        pieces.append(ye)
    pieces.append(rows.new_zeros(rows.shape[0] - offsets[-1], out_features))  # dropped slots
    y = torch.cat(pieces)
    if gates is not None:
        y = y * gates.reshape(-1).index_select(0, sorted_token_idx).to(compute).unsqueeze(1)
    if not grouped_out:
        y = torch.zeros_like(y).index_copy(0, sorted_token_idx, y)  # assignment order
        if gates is not None:
            y = y.view(-1, top_k, out_features).sum(1)
    return y.to(x.dtype)


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Activation = "silu",
                    lora: dict[str, LoRAFactors] | None = None, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, interleaved: bool = False) -> torch.Tensor:
    """Gated expert MLP: out[t] = sum_j w[t, j] (down_e(act(gate_e x_t + bg_e, up_e x_t + bu_e)) + bd_e),
    e = top_k_index[t, j], act(g, u) = act(g) * u or ClampedSwiGLU (moe_types.gated_activation, which
    also says where gate and up sit in gate_up_proj's rows), biases 0 when absent. lora maps
    "gate_up_proj" / "down_proj" to LoRAFactors. The gate_up rows are rounded to hidden's dtype before
    the bias and the activation, as transformers' experts do."""
    lora = lora or {}
    top_k = top_k_index.shape[1]
    sorted_expert_idx, sorted_token_idx, offsets = sort_tokens(top_k_index, gate_up_proj.shape[0])
    gate_up = grouped_linear(hidden, gate_up_proj, sorted_expert_idx, sorted_token_idx, offsets, top_k,
                             grouped_out=True, lora=lora.get("gate_up_proj"))
    if gate_up_bias is not None:
        gate_up = gate_up + _bias_rows(gate_up_bias, sorted_expert_idx)
    inner = gated_activation(gate_up, act, interleaved)
    if down_bias is None:
        return grouped_linear(inner, down_proj, sorted_expert_idx, sorted_token_idx, offsets, top_k, grouped_in=True,
                              gates=top_k_weights, lora=lora.get("down_proj"))
    # Each slot's row with its expert's bias, then weighted and summed per token in fp32.
    down = grouped_linear(inner, down_proj, sorted_expert_idx, sorted_token_idx, offsets, top_k, grouped_in=True,
                          grouped_out=True, lora=lora.get("down_proj"))
    down = down.float() + _bias_rows(down_bias, sorted_expert_idx).float()
    down = torch.zeros_like(down).index_copy(0, sorted_token_idx, down)  # assignment order
    out = (down.view(-1, top_k, down.shape[1]) * top_k_weights.float().unsqueeze(-1)).sum(1)
    return out.to(hidden.dtype)


def _bias_rows(bias: torch.Tensor, sorted_expert_idx: torch.Tensor) -> torch.Tensor:
    """bias[e] for each slot's expert e; zeros for dropped slots (sorted_expert_idx == E)."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, sorted_expert_idx)
