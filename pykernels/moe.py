"""Grouped MoE GEMMs with LoRA on experts (scatter2scatter), for transformers' expert layout.

    >>> top_k_weights, top_k_index = pykernels.moe.route(router_logits, 8, renormalize=True)
    >>> routing = pykernels.moe.sort_tokens(top_k_index, num_experts)
    >>> out = pykernels.moe.experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)

The pure-torch statement of the same ops is pykernels.reference.moe. experts_forward is dispatched
(pykernels/dispatch.py): ours, or torch._grouped_mm where it runs (pykernels/moe_grouped_mm.py),
else the reference; pykernels.backend.set_kernels(moe="torch") forces torch.
"""

from pykernels import dispatch
from pykernels.moe_grouped_mm import torch_experts_forward
from pykernels.moe_route import route
from pykernels.nf4_weight import NF4Weight
from pykernels.ops import moe as _ops
from pykernels.ops.moe import gated_activation, grouped_linear, sort_tokens
from pykernels.moe_types import ClampedSwiGLU, LoRAFactors


def _bucket(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act="silu", lora=None, gate_up_bias=None,
            down_bias=None, interleaved=False):
    experts, inter, width = gate_up_proj.shape[0], down_proj.shape[2], hidden.shape[1]
    base = "nf4" if isinstance(gate_up_proj, NF4Weight) else "dense"
    ranks = ",".join(f"{name}:r{factors.a.shape[-2]}" for name, factors in sorted((lora or {}).items()))
    layout = ((" bias" if gate_up_bias is not None or down_bias is not None else "")
              + (" interleaved" if interleaved else ""))
    return hidden.device, hidden.dtype, (f"tokens<={dispatch.token_bucket(hidden.shape[0])} experts={experts} "
                                         f"top_k={top_k_index.shape[1]} hidden={width} inter={inter} {act} {base}"
                                         + layout + (f" lora={ranks}" if ranks else ""))


experts_forward = dispatch.dispatched("moe", _ops.experts_forward, _bucket, torch_fn=torch_experts_forward)

__all__ = ["ClampedSwiGLU", "LoRAFactors", "experts_forward", "gated_activation", "grouped_linear", "route",
           "sort_tokens"]
