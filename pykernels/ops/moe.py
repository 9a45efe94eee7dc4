"""Grouped MoE ops: public functions and fakes (schemas in csrc/torch_bindings.cpp, autograd in
csrc/moe/moe_autograd.cpp, the pure-torch statement in pykernels/reference/moe.py)."""

from __future__ import annotations

import functools
import os

import torch

from pykernels import backend, moe_types
from pykernels._extension import check_device, ops
from pykernels.nf4_weight import NF4Weight
from pykernels.ops import moe_nf4
from pykernels.reference import moe as reference
from pykernels.moe_types import Activation, ClampedSwiGLU, LoRAFactors, check_activation

_EMPTY_SHAPE = (0,)


# ---------------------------------------------------------------- fake implementations
@torch.library.register_fake("pykernels::moe_sort_tokens")
def _sort_tokens_fake(top_k_index, num_experts):
    slots = top_k_index.numel()
    long = dict(dtype=torch.int64, device=top_k_index.device)
    return torch.empty(slots, **long), torch.empty(slots, **long), torch.empty(num_experts + 1, **long)


def _output_rows(slots, top_k, gates, grouped_out):
    return slots // top_k if gates is not None and not grouped_out else slots


@torch.library.register_fake("pykernels::moe_grouped_linear")
def _grouped_linear_fake(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in,
                         grouped_out, gates=None, lora_a=None, lora_b=None, lora_scaling=1.0):
    torch._check(weight.shape[2] == x.shape[1], lambda: "weight's in_features must match x")
    rows = _output_rows(sorted_token_idx.shape[0], top_k, gates, grouped_out)
    return x.new_empty((rows, weight.shape[1]))


@torch.library.register_fake("pykernels::moe_grouped_linear_backward")
def _grouped_linear_backward_fake(grad_y, x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                  grouped_in, grouped_out, gates, lora_a, lora_b, lora_scaling, compute_grad_x,
                                  compute_grad_weight, compute_grad_gates, compute_grad_lora):
    lora = compute_grad_lora and lora_a is not None
    return (x.new_empty(x.shape if compute_grad_x else _EMPTY_SHAPE),
            weight.new_empty(weight.shape if compute_grad_weight else _EMPTY_SHAPE),
            x.new_empty(gates.shape, dtype=gates.dtype) if compute_grad_gates and gates is not None
            else x.new_empty(_EMPTY_SHAPE),
            x.new_empty(lora_a.shape if lora else _EMPTY_SHAPE),
            x.new_empty(lora_b.shape if lora else _EMPTY_SHAPE))


@torch.library.register_fake("pykernels::moe_gated_act")
def _gated_act_fake(gate_up, act, interleaved, alpha, limit):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_fake("pykernels::moe_gated_act_backward")
def _gated_act_backward_fake(grad_inner, gate_up, act, interleaved, alpha, limit, grad_interleaved=None):
    del grad_interleaved  # either layout has gate_up's shape
    return torch.empty_like(gate_up)


@torch.library.register_fake("pykernels::moe_gate_up_act")
def _gate_up_act_fake(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k, grouped_in, lora_a,
                      lora_b, lora_scaling, act, alpha, limit):
    torch._check(weight.shape[2] == x.shape[1], lambda: "weight's in_features must match x")
    slots, gate_up = sorted_token_idx.shape[0], weight.shape[1]
    return x.new_empty((slots, gate_up // 2)), x.new_empty((slots, gate_up))


# ---------------------------------------------------------------- public functions
def _reference_for(tensor: torch.Tensor) -> bool:
    """The pure-torch path, when asked for (pykernels.backend.set_kernels("reference"))."""
    if backend.use_reference("moe"):
        return True
    check_device(tensor, "input")  # anything but CPU, and CUDA without CUDA kernels: a clear error
    return False


def sort_tokens(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T*k assignments (a = t * k + j) of top_k_index [T, k] ordered by expert, stably:
    (sorted_expert_idx [T*k], sorted_token_idx [T*k] (the assignment in each slot), expert_offsets
    [E + 1]: expert e owns slots expert_offsets[e]:expert_offsets[e + 1]). Ids outside [0, E) (other
    ranks' experts under expert parallelism) sort last and are skipped by grouped_linear. int64, on
    top_k_index's device, no host synchronization on CUDA.

    Example:
        >>> sorted_expert_idx, sorted_token_idx, offsets = pykernels.moe.sort_tokens(top_k_index, 128)
    """
    if not isinstance(top_k_index, torch.Tensor):
        raise ValueError(f"top_k_index must be a tensor, got {type(top_k_index).__name__}")
    if _reference_for(top_k_index):
        return reference.sort_tokens(top_k_index, num_experts)
    return ops.moe_sort_tokens(top_k_index.contiguous(), int(num_experts))


# The op's act codes (csrc/moe/gated_act.h: GatedAct).
_GATED_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_CLAMPED_SWIGLU_CODE = 4


def gated_activation(gate_up: torch.Tensor, act: Activation = "silu", interleaved: bool = False) -> torch.Tensor:
    """The expert MLP's inner activation [rows, I] = act(gate) * up from the gate_up projection
    [rows, 2I], in one pass each way (csrc/moe/gated_act.h): gate and up are the first and last I
    columns (transformers' layout), or alternate columns when interleaved (GPT-OSS). act: "silu",
    "gelu", "gelu_tanh", "relu", "clamped_swiglu" or a ClampedSwiGLU. fp32 math, one rounding per
    output (torch eager rounds act(gate) before the product); gradient to gate_up.

    Example:
        >>> inner = pykernels.moe.gated_activation(gate_up, "silu")   # [T*k, 2I] -> [T*k, I]
    """
    check_activation(act)
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError("gate_up must be a 2-D [rows, 2 * intermediate] tensor, got "
                         f"{tuple(gate_up.shape) if isinstance(gate_up, torch.Tensor) else type(gate_up).__name__}")
    if _reference_for(gate_up):
        return moe_types.gated_activation(gate_up, act, interleaved)
    code, alpha, limit = _act_arguments(act)
    return ops.moe_gated_act(gate_up.contiguous(), code, bool(interleaved), alpha, limit)


def _act_arguments(act: Activation) -> tuple[int, float, float]:
    """The ops' (act, alpha, limit) arguments for a checked activation."""
    if act == "clamped_swiglu":
        act = ClampedSwiGLU()
    if isinstance(act, ClampedSwiGLU):
        return _CLAMPED_SWIGLU_CODE, float(act.alpha), float(act.limit)
    return _GATED_ACT_CODES[act], 0.0, 0.0


_MOE_ACT_KNOB = "PYKERNELS_SM90_MOE_ACT"


def _act_in_gate_up_epilogue(hidden: torch.Tensor) -> bool:
    """PYKERNELS_SM90_MOE_ACT (read on every call): `separate` (the default, also when unset) runs the
    experts' gated activation as its own pass after the gate_up GEMM; `epilogue` runs both as one op,
    moe_gate_up_act, whose Hopper kernel computes act(gate) * up in the GEMM's epilogue
    (csrc/common/paired_rows.h; elsewhere the op composes the two kernels). On CUDA tensors only.
    `separate` stays the default until a GPU has timed both (benchmarks/tile_sweep.py, op moe_act)."""
    setting = os.environ.get(_MOE_ACT_KNOB) or "separate"
    if setting not in ("separate", "epilogue"):
        raise ValueError(f"{_MOE_ACT_KNOB} must be separate (the default) or epilogue, got {setting!r}")
    return setting == "epilogue" and hidden.is_cuda


def _top_k(x, sorted_token_idx, grouped_in, gates) -> int:
    slots = sorted_token_idx.shape[0]
    if grouped_in:  # rows are slots already: k only matters for summing gated slots per token
        return gates.shape[1] if gates is not None and gates.dim() == 2 else 1
    if x.dim() != 2 or (x.shape[0] == 0 and slots) or (x.shape[0] and slots % x.shape[0]):
        raise ValueError(f"x must be [tokens, in_features] with tokens dividing the {slots} assignments, got "
                         f"{tuple(x.shape)}")
    return slots // x.shape[0] if x.shape[0] else 1


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idx: torch.Tensor,
                   sorted_token_idx: torch.Tensor, expert_offsets: torch.Tensor, grouped_in: bool = False,
                   grouped_out: bool = False, gates: torch.Tensor | None = None,
                   lora: LoRAFactors | None = None) -> torch.Tensor:
    """Expert linear per assignment slot (scatter2scatter): y_s = x_s W_e^T (+ LoRA) (* gate) for
    the slots of sort_tokens. weight [E, out, in] (transformers' expert layout); x [T, in] read by
    token, or [T*k, in] already in slot order (grouped_in). Output [T*k, out] in slot order
    (grouped_out), in assignment order, or, with gates [T, k] and not grouped_out, [T, out] summed
    over each token's k experts. lora: LoRAFactors in PEFT's target_parameters layout. Gradients to
    x, weight, gates and the LoRA factors; fp32 accumulation.

    Example (one expert MLP's down projection, combined per token):
        >>> y = pykernels.moe.grouped_linear(inner, down_proj, *sort_tokens(idx, E), grouped_in=True, gates=w)
    """
    if _reference_for(x):
        top_k = _top_k(x, sorted_token_idx, grouped_in, gates)
        return reference.grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                        grouped_in, grouped_out, gates, lora)
    top_k = _top_k(x, sorted_token_idx, grouped_in, gates)
    lora_a, lora_b, scaling = (lora.a, lora.b, float(lora.scaling)) if lora is not None else (None, None, 1.0)
    return ops.moe_grouped_linear(x, weight, sorted_expert_idx, sorted_token_idx, expert_offsets, top_k,
                                  bool(grouped_in), bool(grouped_out), gates, lora_a, lora_b, scaling)


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor | NF4Weight, down_proj: torch.Tensor | NF4Weight,
                    act: Activation = "silu", lora: dict[str, LoRAFactors] | None = None,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                    interleaved: bool = False) -> torch.Tensor:
    """Gated expert MLP of a transformers MoE block: out[t] = sum_j w[t, j] down_e(act(gate_e x_t) *
    up_e x_t), e = top_k_index[t, j]. hidden [T, H]; gate_up_proj [E, 2I, H] (gate rows, then up;
    alternating gate and up rows when interleaved, GPT-OSS); down_proj [E, H, I] (weights stored
    [E, in, out] go in as transposed views: the CPU kernels and the Hopper GEMMs read them in place,
    the sm80 kernels copy them per call); top_k_weights
    [T, k] (fp32 or hidden's dtype); act a name of pykernels.moe_types.ACTIVATIONS, "clamped_swiglu"
    or a ClampedSwiGLU (GPT-OSS); lora maps "gate_up_proj" / "down_proj" to LoRAFactors; optional
    per-expert biases gate_up_bias [E, 2I] and down_bias [E, H] (GPT-OSS), added before the routing
    weight. Gradients to hidden, top_k_weights, the expert weights, the biases and LoRA. The expert
    weights may both be frozen NF4Weights [E, out, in] (QLoRA): they are dequantized in the forward
    and again in the backward (only the routed experts when T * k < E), without a host sync.

    The biases run as torch epilogues around the two grouped GEMMs (elementwise work on the [T*k, 2I]
    and [T, k, H] rows the GEMMs write anyway), the activation as one pass each way
    (gated_activation).

    Example:
        >>> out = pykernels.moe.experts_forward(h, idx, w, experts.gate_up_proj, experts.down_proj)
    """
    check_activation(act)
    nf4 = isinstance(gate_up_proj, NF4Weight)
    if nf4 != isinstance(down_proj, NF4Weight):
        raise ValueError("gate_up_proj and down_proj must both be NF4Weights or both be tensors, got "
                         f"{type(gate_up_proj).__name__} and {type(down_proj).__name__}")
    gate_up_shape, down_shape = tuple(gate_up_proj.shape), tuple(down_proj.shape)
    if len(gate_up_shape) != 3 or len(down_shape) != 3 or gate_up_shape[1] != 2 * down_shape[2]:
        raise ValueError(f"gate_up_proj must be [E, 2I, H] and down_proj [E, H, I], got {gate_up_shape} and "
                         f"{down_shape}")
    if top_k_index.dim() != 2 or top_k_weights.shape != top_k_index.shape:
        raise ValueError("top_k_index and top_k_weights must both be [tokens, top_k], got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    biases = {"gate_up_bias": (gate_up_bias, gate_up_shape[:2]), "down_bias": (down_bias, down_shape[:2])}
    for name, (bias, shape) in biases.items():
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} ([E, out_features] of its weight), got "
                             f"{tuple(bias.shape)}")
    lora = lora or {}
    unknown = set(lora) - {"gate_up_proj", "down_proj"}
    if unknown:
        raise ValueError(f"lora keys must be 'gate_up_proj' and/or 'down_proj', got {sorted(unknown)}")
    if _reference_for(hidden):
        if nf4:
            gate_up_proj, down_proj = gate_up_proj.dequantize(hidden.dtype), down_proj.dequantize(hidden.dtype)
        return reference.experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act, lora,
                                         gate_up_bias, down_bias, interleaved)
    routing = sort_tokens(top_k_index, gate_up_shape[0])
    if nf4:
        gate_up_linear, down_linear = _nf4_linears(hidden, top_k_weights, gate_up_proj, down_proj, routing)
    else:
        gate_up_linear = functools.partial(grouped_linear, weight=gate_up_proj, sorted_expert_idx=routing[0],
                                           sorted_token_idx=routing[1], expert_offsets=routing[2])
        down_linear = functools.partial(grouped_linear, weight=down_proj, sorted_expert_idx=routing[0],
                                        sorted_token_idx=routing[1], expert_offsets=routing[2])
    if not nf4 and gate_up_bias is None and not interleaved and _act_in_gate_up_epilogue(hidden):
        inner = _gate_up_act(hidden, gate_up_proj, routing, lora.get("gate_up_proj"), act)
    else:
        gate_up = gate_up_linear(hidden, grouped_out=True, lora=lora.get("gate_up_proj"))
        if gate_up_bias is not None:
            gate_up = gate_up + _bias_of_slots(gate_up_bias, routing[0])
        inner = gated_activation(gate_up, act, interleaved)
    out = down_linear(inner, grouped_in=True, gates=top_k_weights, lora=lora.get("down_proj"))
    if down_bias is None:
        return out
    return (out.float() + _weighted_bias(down_bias, top_k_index, top_k_weights)).to(out.dtype)


def _gate_up_act(hidden, gate_up_proj, routing, lora: LoRAFactors | None, act: Activation) -> torch.Tensor:
    """inner [T*k, I] in slot order: the gate_up projection and the activation as one op (moe_gate_up_act)."""
    top_k = _top_k(hidden, routing[1], False, None)
    lora_a, lora_b, scaling = (lora.a, lora.b, float(lora.scaling)) if lora is not None else (None, None, 1.0)
    code, alpha, limit = _act_arguments(act)
    return ops.moe_gate_up_act(hidden, gate_up_proj, *routing, top_k, False, lora_a, lora_b, scaling, code, alpha,
                               limit)[0]


def _bias_of_slots(bias: torch.Tensor, sorted_expert_idx: torch.Tensor) -> torch.Tensor:
    """[T*k, out]: bias[e] for each slot's expert e, zeros for dropped slots (sorted_expert_idx == E)."""
    return torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).index_select(0, sorted_expert_idx)


def _weighted_bias(bias: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """[T, out] fp32: sum_j w[t, j] bias[top_k_index[t, j]], ids outside [0, E) adding nothing."""
    num_experts = bias.shape[0]
    index = top_k_index.long()
    index = torch.where((index >= 0) & (index < num_experts), index, num_experts)
    rows = torch.cat([bias, bias.new_zeros(1, bias.shape[1])]).float()[index]  # [T, k, out]
    return torch.bmm(top_k_weights.float().unsqueeze(1), rows).squeeze(1)


def _nf4_linears(hidden, top_k_weights, gate_up_proj: NF4Weight, down_proj: NF4Weight, routing):
    """grouped_linear's NF4 twins for one call (moe_nf4.compact_routing: which experts are dequantized)."""
    if down_proj.shape[0] != gate_up_proj.shape[0]:
        raise ValueError(f"gate_up_proj has {gate_up_proj.shape[0]} experts and down_proj {down_proj.shape[0]}")
    for weight, name in ((gate_up_proj, "gate_up_proj"), (down_proj, "down_proj")):
        if weight.device != hidden.device:
            raise ValueError(f"{name} is on {weight.device} but hidden is on {hidden.device}")
    routed = moe_nf4.compact_routing(*routing)
    top_k = top_k_weights.shape[1]
    return (functools.partial(moe_nf4.grouped_linear_nf4, weight=gate_up_proj, routing=routed, top_k=top_k),
            functools.partial(moe_nf4.grouped_linear_nf4, weight=down_proj, routing=routed, top_k=top_k))
