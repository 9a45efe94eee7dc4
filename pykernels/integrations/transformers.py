"""transformers integrations: packed sequences (below) and the grouped MoE experts implementation
(apply_moe_kernels, in moe_experts.py).

Run a causal LM on packed sequences: one row, no padding, many sequences.

    >>> hidden = packed_hidden_states(model, input_ids_flat, cu_seqlens)      # [L, H]
    >>> targets = pykernels.logprobs.packed_targets(input_ids_flat, cu_seqlens)
    >>> logprobs = pykernels.logprobs.token_logprobs(hidden, model.get_output_embeddings().weight, targets)

Position ids restart at 0 in every sequence. Flash-attention backends get cu_seqlens directly (the
varlen kernels, no mask); eager and SDPA get a block-diagonal causal mask, so no token attends
across a sequence boundary.
"""

from __future__ import annotations

import torch

from pykernels.integrations.moe_experts import apply_moe_kernels, quantizable_experts, quantize_moe_experts

__all__ = [
    "apply_moe_kernels",
    "block_causal_mask",
    "packed_attention_kwargs",
    "packed_hidden_states",
    "packed_position_ids",
    "quantizable_experts",
    "quantize_moe_experts",
]

_VARLEN_BACKENDS = (
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn",
    "kernels-community/vllm-flash-attn3",
)


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[L] positions restarting at 0 at every sequence start cu_seqlens[i]."""
    lengths = cu_seqlens.diff()
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def block_causal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, L, L] mask: each token sees earlier tokens of its own sequence only."""
    length = int(cu_seqlens[-1])
    positions = torch.arange(length, device=cu_seqlens.device)
    sequence_of = torch.bucketize(positions, cu_seqlens[1:], right=True)
    allowed = (sequence_of[:, None] == sequence_of[None, :]) & (positions[:, None] >= positions[None, :])
    mask = torch.zeros(length, length, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def _check_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1], got shape {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != length or bool((cu_seqlens.diff() <= 0).any()):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {length}, got "
                         f"{cu_seqlens.tolist()}")


def packed_attention_kwargs(causal_lm: torch.nn.Module, cu_seqlens: torch.Tensor) -> dict:
    """The attention arguments of a decoder forward over packed sequences: cu_seqlens for the
    flash-attention (varlen) backends, a block-diagonal causal mask for the others."""
    if causal_lm.config._attn_implementation in _VARLEN_BACKENDS:
        cu = cu_seqlens.to(dtype=torch.int32)
        max_length = int(cu_seqlens.diff().max())
        return dict(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_length,
                    max_length_k=max_length)
    return dict(attention_mask=block_causal_mask(cu_seqlens, causal_lm.dtype))


def packed_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states [L, H] (after the last norm, before the lm_head) of packed sequences.

    Args:
        model: a transformers causal LM, or a PEFT wrapper of one.
        input_ids: [L] or [1, L] token ids of the sequences laid end to end.
        cu_seqlens: [S + 1] sequence starts (cu_seqlens[0] = 0, cu_seqlens[-1] = L).
        position_ids: [L] or [1, L]; default restarts at 0 in each sequence.
    """
    input_ids = input_ids.reshape(1, -1)
    _check_cu_seqlens(cu_seqlens, input_ids.shape[1])
    if position_ids is None:
        position_ids = packed_position_ids(cu_seqlens)
    position_ids = position_ids.reshape(1, -1).to(input_ids.device)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = causal_lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                     **packed_attention_kwargs(causal_lm, cu_seqlens.to(input_ids.device)))
    return output.last_hidden_state[0]
