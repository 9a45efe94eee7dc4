"""transformers experts implementation "pykernels": the grouped MoE kernels behind transformers'
experts interface (transformers >= 5: experts classes decorated with use_experts_implementation,
gate_up_proj [E, 2I, H], down_proj [E, H, I]).

PEFT LoRA on experts (LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])) works by
parametrizing the expert weights during its forward: reading self.gate_up_proj would build the
dense W + B A for every expert. We read the base weight and the LoRA factors instead and run LoRA
inside the grouped GEMM (pykernels.moe.grouped_linear). Anything we do not cover (biases,
transposed or interleaved weights, other activations, several active adapters) runs transformers'
own forward.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from pykernels.reference.moe import LoRAFactors

IMPLEMENTATION = "pykernels"
# config.hidden_act -> pykernels.moe activation name
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _weight_and_lora(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, LoRAFactors | None] | None:
    """The base weight and PEFT's LoRA factors of one expert parameter; None when PEFT is adding a
    dense delta we cannot split (several adapters, fp8)."""
    if not parametrize.is_parametrized(module, name):
        return getattr(module, name), None
    from peft.tuners.lora.layer import _LoraFactorsProxy  # only parametrized by PEFT's ParamWrapper

    chain = module.parametrizations[name]
    if len(chain) != 1 or not isinstance(chain[0], _LoraFactorsProxy):
        return None
    # PEFT (get_delta_factors): lhs = lora_B.view(out, r, E).permute(2, 0, 1) [E, out, r] and
    # rhs = lora_A.view(E, r, in); delta_e = scaling * lhs[e] @ rhs[e]. Undo the views: the op
    # takes PEFT's own layout (lora_A [r*E, in], lora_B [out, r*E]), so no copy is made.
    lhs, rhs = chain[0].lhs, chain[0].rhs
    experts, out_features, rank = lhs.shape
    lora_b = lhs.permute(1, 2, 0).reshape(out_features, rank * experts)
    lora_a = rhs.reshape(experts * rank, rhs.shape[2])
    return chain.original, LoRAFactors(lora_a, lora_b, float(chain[0].scaling))


def pykernels_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts-interface function (self is the experts module)."""
    from pykernels.moe import experts_forward

    act = _ACTIVATIONS.get(getattr(self.config, "hidden_act", None))
    covered = (act is not None and getattr(self, "has_gate", True) and not getattr(self, "has_bias", False)
               and not getattr(self, "is_transposed", False) and getattr(self, "is_concatenated", True))
    weights = [_weight_and_lora(self, name) for name in ("gate_up_proj", "down_proj")] if covered else [None]
    if any(w is None for w in weights):
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    (gate_up, gate_up_lora), (down, down_lora) = weights
    lora = {name: f for name, f in (("gate_up_proj", gate_up_lora), ("down_proj", down_lora)) if f is not None}
    return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up, down, act=act, lora=lora)


def _experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    # PEFT's wrappers forward attribute lookups to their base layer: count the experts modules only.
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "gate_up_proj")
            and hasattr(m, "down_proj") and not hasattr(m, "base_layer")]


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
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation(IMPLEMENTATION)
    else:  # a bare decoder stack: its config is shared with the experts modules
        for module in experts:
            module.config._experts_implementation = IMPLEMENTATION
    return len(experts)
