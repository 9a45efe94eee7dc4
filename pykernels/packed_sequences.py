"""Packed sequences (several sequences in one row, boundaries in cu_seqlens): their next-token
targets, shared by the logprobs op, the integrations and the pure-torch reference."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # the target of a position that predicts nothing (as torch's cross_entropy)


def packed_targets(input_ids_flat: torch.Tensor, cu_seqlens: torch.Tensor,
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of packed sequences: the shift stays inside each sequence, and the last
    token of every sequence gets ignore_index (it must not predict the next sequence's first)."""
    targets = torch.full_like(input_ids_flat, ignore_index)
    targets[:-1] = input_ids_flat[1:]
    last_positions = cu_seqlens[1:] - 1
    targets[last_positions[last_positions >= 0]] = ignore_index
    return targets
