"""The torch call the grouped MoE kernels replace: experts on torch._grouped_mm.

transformers' "grouped_mm" experts implementation does the same: sort the token-expert
assignments by expert, one grouped GEMM for gate_up and one for down, weight and scatter-add back.
It runs on CUDA in bf16 for dense expert weights without LoRA on them; everything else (NF4
experts, LoRA on experts, other dtypes, a torch without _grouped_mm or a GPU it rejects) takes the
pure-torch reference, pykernels.reference.moe.
"""

from __future__ import annotations

import torch

from pykernels import backend
from pykernels.nf4_weight import NF4Weight
from pykernels.moe_types import gated_activation

_rejected: set[str] = set()  # devices whose torch._grouped_mm raised: the reference from then on


def experts_forward_grouped_mm(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                               gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act="silu", gate_up_bias=None,
                               down_bias=None, interleaved=False) -> torch.Tensor:
    """out[t] = sum_j w[t, j] (down_e(act(gate_e x_t, up_e x_t)) + bias) on two torch._grouped_mm calls.
    Ids outside [0, E) (other ranks' experts) get weight 0; no host synchronization."""
    tokens, top_k = top_k_index.shape
    num_experts = gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    order = torch.sort(flat.clamp(0, num_experts - 1), stable=True)
    token_of_slot = order.indices // top_k
    offsets = torch.bincount(order.values, minlength=num_experts).cumsum(0).to(torch.int32)
    gate_up = torch._grouped_mm(hidden[token_of_slot], gate_up_proj.transpose(1, 2), offs=offsets)
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[order.values]
    down = torch._grouped_mm(gated_activation(gate_up, act, interleaved), down_proj.transpose(1, 2), offs=offsets)
    if down_bias is not None:
        down = down + down_bias[order.values]
    weights = torch.where(valid, top_k_weights.reshape(-1).float(), 0.0)[order.indices]
    out = hidden.new_zeros(hidden.shape, dtype=torch.float32)
    return out.index_add_(0, token_of_slot, down.float() * weights.unsqueeze(1)).to(hidden.dtype)


def _grouped_mm_runs(hidden, gate_up_proj, lora) -> bool:
    return (hasattr(torch, "_grouped_mm") and hidden.is_cuda and hidden.dtype == torch.bfloat16 and not lora
            and not isinstance(gate_up_proj, NF4Weight) and str(hidden.device) not in _rejected)


def torch_experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act="silu", lora=None,
                          gate_up_bias=None, down_bias=None, interleaved=False):
    """pykernels.moe.experts_forward's torch side: torch._grouped_mm where it runs, else the reference."""
    layout = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, interleaved=interleaved)
    if _grouped_mm_runs(hidden, gate_up_proj, lora):
        try:
            return experts_forward_grouped_mm(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                                              **layout)
        except RuntimeError:  # e.g. a compute capability or alignment this torch's grouped GEMM rejects
            _rejected.add(str(hidden.device))
    from pykernels.ops import moe as ops_moe  # the public function's checks, on its reference path

    with backend.forced("moe", "torch"):
        return ops_moe.experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, lora,
                                       **layout)
