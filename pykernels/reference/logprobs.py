"""Pure-torch per-token logprobs (and entropy) under softmax(hidden @ weight.T / temperature).

The readable statement of pykernels.logprobs' ops: the test oracle and the fallback under
pykernels.backend.set_kernels("reference"). Chunked over tokens with activation checkpointing, so
the [N, V] logits exist one chunk at a time in the forward and are recomputed chunk by chunk in the
backward (in fp32, from an fp32 copy of the weight: accurate, not lean).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from pykernels.packed_sequences import IGNORE_INDEX

CHUNK_TOKENS = 2048  # rows of logits alive at once: 2048 x 151936 fp32 is 1.2 GiB


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden.float() @ weight.float().T) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    picked = log_probs.gather(1, torch.where(valid, targets, 0).unsqueeze(1)).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    zero = torch.zeros((), dtype=picked.dtype, device=picked.device)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   ignore_index: int = IGNORE_INDEX, return_entropy: bool = False):
    """logprobs [N] fp32 of targets (0 where targets == ignore_index), and entropy [N] if asked."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] must share H, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    valid = targets != ignore_index
    if bool(((targets < 0) | (targets >= weight.shape[0]))[valid].any()):
        raise ValueError(f"targets must be in [0, {weight.shape[0]}) or ignore_index {ignore_index}")
    chunks = []
    for start in range(0, hidden.shape[0], CHUNK_TOKENS):
        rows = slice(start, start + CHUNK_TOKENS)
        args = (hidden[rows], weight, targets[rows], temperature, ignore_index)
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        chunks.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False) if needs_grad
                      else _chunk_logprobs(*args))
    logprobs = torch.cat([c[0] for c in chunks]) if chunks else hidden.new_zeros(0, dtype=torch.float32)
    if not return_entropy:
        return logprobs
    entropy = torch.cat([c[1] for c in chunks]) if chunks else hidden.new_zeros(0, dtype=torch.float32)
    return logprobs, entropy
