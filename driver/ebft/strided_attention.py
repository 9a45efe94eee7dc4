"""The attention of strided mode's full-row forwards (block features, the training loss): the
block-parallel mask as a flex_attention BlockMask (block-sparse: fully masked tiles are skipped) or
as a dense [L, L] mask for SDPA / eager.

FlexAttention has no backward on CPU, so `auto` picks flex on CUDA only. Generation always uses the
dense mask: its rows grow every step, and a flex kernel would be compiled for every new shape.
"""

from __future__ import annotations

import contextlib

import torch

from driver.ebft.strided_generate import StridedRollout, row_inputs
from driver.ebft.strided_layout import mask_mod
from driver.engine import RolloutError
from driver.policy.logprobs import causal_lm_of
from driver.policy.model import Policy

FLEX_IMPLEMENTATION = "flex_attention"


def attention_mask_dtype(policy: Policy) -> torch.dtype | None:
    """The eager backend adds the mask to its scores (a bool mask would be silently wrong there)."""
    causal_lm = policy.causal_lm
    return causal_lm.dtype if causal_lm.config._attn_implementation == "eager" else None


def uses_flex(attention: str, device: torch.device) -> bool:
    if attention == "flex" and device.type != "cuda":
        raise RolloutError(f"ebft.attention = flex needs a CUDA device, the trainer is on {device} (FlexAttention "
                           "has no backward on CPU); use auto or dense")
    return attention == "flex" or (attention == "auto" and device.type == "cuda")


@contextlib.contextmanager
def full_row_attention(policy: Policy, rollout: StridedRollout, flex: bool, model: torch.nn.Module | None = None):
    """Yields (input_ids [1, L], position_ids [1, L], mask) for one forward of the rollout's row; with
    flex the model runs transformers' flex_attention inside the block (restored after). model: the network the
    forward runs, when not the policy's own (the frozen base of EBFT's features: under full fine-tuning a copy)."""
    if not flex:
        yield row_inputs(rollout, policy.device, attention_mask_dtype(policy))
        return
    from torch.nn.attention.flex_attention import create_block_mask

    device, causal_lm = policy.device, causal_lm_of(model if model is not None else policy.model)
    meta = rollout.meta.to(device)
    block_mask = create_block_mask(mask_mod(meta), None, None, len(meta), len(meta), device=device)
    previous = causal_lm.config._attn_implementation
    causal_lm.set_attn_implementation(FLEX_IMPLEMENTATION)
    try:
        yield rollout.input_ids.to(device)[None], meta.pos[None], block_mask
    finally:
        causal_lm.set_attn_implementation(previous)
