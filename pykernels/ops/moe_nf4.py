"""Grouped MoE experts on NF4 expert weights (QLoRA on MoE models): the expert weights are dequantized
in the forward and again in the backward instead of being kept for it; when the call has fewer
assignments than experts (T * k < E), only the routed experts.

Expert e of an NF4Weight [E, out, in] owns elements [e n, (e + 1) n), n = out * in, so with n a
multiple of the block size its packed bytes and block scales are contiguous slices: the listed
experts' slices are gathered into one smaller NF4Weight and dequantized by one kernel call into
[E_used, out, in]. The routing and the LoRA factors are renumbered to match (experts without
tokens are never read by the grouped GEMM, so dropping them changes nothing but the work).

Nothing here reads the routing on the host: the list of experts has a size known from the shapes,
min(E, T * k), so a CUDA step never waits for the GPU here (torch.nonzero would, once per MoE layer,
and would break torch.compile's graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pykernels._extension import ops
from pykernels.nf4_weight import NF4Weight
from pykernels.moe_types import LoRAFactors


@dataclass(frozen=True)
class CompactRouting:
    """sort_tokens' routing renumbered to a list of experts: expert experts[i] is i."""

    experts: torch.Tensor  # int64 [E_used]: original ids, ascending, then repeats of 0 that no slot reads
    sorted_expert_idx: torch.Tensor
    sorted_token_idx: torch.Tensor
    expert_offsets: torch.Tensor  # [E_used + 1]
    num_experts: int  # E before compaction

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sorted_expert_idx, self.sorted_token_idx, self.expert_offsets


def compact_routing(sorted_expert_idx: torch.Tensor, sorted_token_idx: torch.Tensor,
                    expert_offsets: torch.Tensor) -> CompactRouting:
    """sort_tokens' routing over min(E, T * k) experts, without a host synchronization: all E when
    every expert could have a token (T * k >= E: any training batch; the routing as it is), else the
    routed ones in id order, padded with empty groups that list expert 0 (their LoRA rows get zero
    gradient; their dequantized copies are never read)."""
    num_experts = expert_offsets.numel() - 1
    slots = sorted_expert_idx.numel()
    if slots >= num_experts:
        experts = torch.arange(num_experts, device=expert_offsets.device)
        return CompactRouting(experts, sorted_expert_idx, sorted_token_idx, expert_offsets, num_experts)
    size = max(slots, 1)  # the ops need E >= 1: no tokens keep one empty expert
    routed = expert_offsets.diff() > 0  # at most T * k of them
    listed = torch.nonzero_static(routed, size=size, fill_value=num_experts).flatten()
    # renumber[e]: e's place among the routed experts; unrouted ids and the dropped bucket (E) go
    # to the last bucket, size.
    place = torch.where(routed, routed.cumsum(0) - 1, size)
    renumber = torch.cat([place, place.new_full((1,), size)])
    offsets = torch.cat([expert_offsets[listed], expert_offsets[-1:]])  # padding: empty groups at the end
    experts = torch.where(listed < num_experts, listed, 0)
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
    if experts.numel() == num_experts:  # every expert, in order (compact_routing lists fewer otherwise)
        return lora
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
