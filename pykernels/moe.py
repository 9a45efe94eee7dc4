"""Grouped MoE GEMMs with LoRA on experts (scatter2scatter), for transformers' expert layout.

    >>> top_k_weights, top_k_index = pykernels.moe.route(router_logits, 8, renormalize=True)
    >>> routing = pykernels.moe.sort_tokens(top_k_index, num_experts)
    >>> out = pykernels.moe.experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)

The pure-torch statement of the same ops is pykernels.reference.moe;
pykernels.backend.set_kernels("reference") switches to it.
"""

from pykernels.moe_route import route
from pykernels.ops.moe import experts_forward, grouped_linear, sort_tokens
from pykernels.reference.moe import LoRAFactors

__all__ = ["LoRAFactors", "experts_forward", "grouped_linear", "route", "sort_tokens"]
