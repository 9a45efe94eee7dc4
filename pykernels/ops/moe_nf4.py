"""Grouped MoE experts on NF4 expert weights (QLoRA on MoE models): only the experts that received
tokens are dequantized, and again in the backward instead of being kept for it.

Expert e of an NF4Weight [E, out, in] owns elements [e n, (e + 1) n), n = out * in, so with n a
multiple of the block size its packed bytes and block scales are contiguous slices: the routed
experts' slices are gathered into one smaller NF4Weight and dequantized by one kernel call into
[E_used, out, in]. The routing and the LoRA factors are renumbered to match (experts without
tokens are never read by the grouped GEMM, so dropping them changes nothing but the work).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pykernels._extension import ops
from pykernels.nf4_weight import NF4Weight
from pykernels.moe_types import LoRAFactors


@dataclass(frozen=True)
class CompactRouting:
    """sort_tokens' routing with the experts that received tokens renumbered 0..E_used-1."""

    experts: torch.Tensor  # int64 [E_used]: original ids of the routed experts, ascending
    sorted_expert_idx: torch.Tensor
    sorted_token_idx: torch.Tensor
    expert_offsets: torch.Tensor  # [E_used + 1]
    num_experts: int  # E before compaction

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sorted_expert_idx, self.sorted_token_idx, self.expert_offsets


def compact_routing(sorted_expert_idx: torch.Tensor, sorted_token_idx: torch.Tensor,
                    expert_offsets: torch.Tensor) -> CompactRouting:
    """Drop the experts without tokens from sort_tokens' routing (one host synchronization)."""
    num_experts = expert_offsets.numel() - 1
    experts = torch.nonzero(expert_offsets.diff() > 0).flatten()
    if experts.numel() == 0:  # no tokens, or every id dropped: keep one (empty) expert, the ops need E >= 1
        experts = experts.new_zeros(1)
    renumber = torch.full((num_experts + 1,), experts.numel(), dtype=torch.int64, device=experts.device)
    renumber[experts] = torch.arange(experts.numel(), device=experts.device)  # dropped ids (= E) stay last
    offsets = torch.cat([expert_offsets[experts], expert_offsets[-1:]])
    return CompactRouting(experts, renumber[sorted_expert_idx], sorted_token_idx, offsets, num_experts)


def compact_lora(lora: LoRAFactors | None, routing: CompactRouting) -> LoRAFactors | None:
    """The routed experts' LoRA factors in PEFT's layout for E_used experts (differentiable gathers):
    A [r*E, in] is expert-major, B [out, r*E] expert-minor (B_e = B[:, e::E])."""
    if lora is None:
        return None
    experts, num_experts = routing.experts, routing.num_experts
    if lora.a.dim() != 2 or lora.b.dim() != 2 or lora.a.shape[0] % num_experts or lora.b.shape[1] != lora.a.shape[0]:
        raise ValueError(f"LoRA factors for {num_experts} experts must be A [r*E, in] and B [out, r*E], got "
                         f"{tuple(lora.a.shape)} and {tuple(lora.b.shape)}")
    rank = lora.a.shape[0] // num_experts
    a = lora.a.view(num_experts, rank, -1)[experts].reshape(experts.numel() * rank, -1)
    b = lora.b.view(lora.b.shape[0], rank, num_experts)[:, :, experts].reshape(lora.b.shape[0], -1)
    return LoRAFactors(a, b, lora.scaling)


def dequantize_experts(weight: NF4Weight, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[len(experts), out, in] in dtype: the listed experts of an NF4 [E, out, in] weight, bit-equal
    to weight.dequantize(dtype)[experts]. Dequantizes everything when an expert does not start on a
    block boundary (n not a multiple of the block size) or when every expert is listed."""
    num_experts, out_features, in_features = weight.shape
    per_expert = out_features * in_features
    if experts.numel() == num_experts or per_expert % weight.blocksize:
        full = weight.dequantize(dtype)
        return full if experts.numel() == num_experts else full[experts]
    blocks = per_expert // weight.blocksize  # also makes per_expert even: bytes split at experts too
    block_idx = (experts[:, None] * blocks + torch.arange(blocks, device=experts.device)).flatten()
    if weight.double_quant:
        # The same two fp32 roundings as the full dequantize: code[q] * nested scale, then + offset.
        absmax = (weight.nested_code[weight.absmax_q[block_idx].long()]
                  * weight.nested_absmax[block_idx // weight.nested_blocksize]) + weight.nested_offset
    else:
        absmax = weight.absmax[block_idx]
    packed = weight.packed.view(num_experts, per_expert // 2)[experts].flatten()
    routed = NF4Weight(packed=packed, shape=torch.Size((experts.numel(), out_features, in_features)),
                       dtype=weight.dtype, blocksize=weight.blocksize, absmax=absmax)
    return routed.dequantize(dtype)


class GroupedLinearNF4(torch.autograd.Function):
    """grouped_linear on a frozen NF4 expert weight: gradients to x, gates and LoRA; the routed
    experts are dequantized in the forward and again in the backward (never saved: QLoRA's memory)."""

    @staticmethod
    def forward(ctx, x, gates, lora_a, lora_b, weight: NF4Weight, routing: CompactRouting, top_k: int,
                grouped_in: bool, grouped_out: bool, lora_scaling: float):
        dense = dequantize_experts(weight, routing.experts, x.dtype)
        ctx.save_for_backward(x, gates, lora_a, lora_b)
        ctx.weight, ctx.routing = weight, routing
        ctx.flags = (top_k, grouped_in, grouped_out)
        ctx.lora_scaling = lora_scaling
        return ops.moe_grouped_linear(x, dense, *routing.tensors, top_k, grouped_in, grouped_out, gates, lora_a,
                                      lora_b, lora_scaling)

    @staticmethod
    def backward(ctx, grad_y):
        x, gates, lora_a, lora_b = ctx.saved_tensors
        need_x, need_gates, need_a, need_b = ctx.needs_input_grad[:4]
        dense = dequantize_experts(ctx.weight, ctx.routing.experts, x.dtype)
        grad_x, _, grad_gates, grad_a, grad_b = ops.moe_grouped_linear_backward(
            grad_y.contiguous(), x, dense, *ctx.routing.tensors, *ctx.flags, gates, lora_a, lora_b,
            ctx.lora_scaling, need_x, False, need_gates, need_a or need_b)
        return (grad_x if need_x else None, grad_gates if need_gates else None, grad_a if need_a else None,
                grad_b if need_b else None, None, None, None, None, None, None)


def grouped_linear_nf4(x: torch.Tensor, weight: NF4Weight, routing: CompactRouting, top_k: int,
                       grouped_in: bool = False, grouped_out: bool = False, gates: torch.Tensor | None = None,
                       lora: LoRAFactors | None = None) -> torch.Tensor:
    lora = compact_lora(lora, routing)
    lora_a, lora_b, scaling = (lora.a, lora.b, float(lora.scaling)) if lora is not None else (None, None, 1.0)
    return GroupedLinearNF4.apply(x, gates, lora_a, lora_b, weight, routing, top_k, grouped_in, grouped_out,
                                  scaling)
