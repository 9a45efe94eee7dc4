"""Score completions on packed sequences: one row, no padding, position ids restarting per sequence.

Many completions of different lengths go through the model in one forward pass
(pykernels.integrations.transformers.packed_hidden_states: cu_seqlens to flash-attention, a
block-diagonal causal mask for eager/SDPA). Logprobs are computed only at
the positions that predict completion tokens, with pykernels.logprobs (lm_head fused in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pykernels.integrations.transformers import packed_hidden_states
from pykernels.logprobs import packed_targets, token_logprobs


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    cu_seqlens: torch.Tensor  # [S + 1] sequence starts in the packed row
    prompt_lengths: list[int]
    completion_lengths: list[int]

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lengths)

    def completion_positions(self) -> torch.Tensor:
        """Row positions whose next-token prediction is a completion token, sequence by sequence."""
        starts = self.cu_seqlens[:-1].tolist()
        parts = [torch.arange(start + p - 1, start + p - 1 + c)
                 for start, p, c in zip(starts, self.prompt_lengths, self.completion_lengths)]
        return torch.cat(parts).to(self.input_ids.device) if parts else torch.zeros(0, dtype=torch.long)


def pack(prompts: list[list[int]], completions: list[list[int]], device: torch.device | str = "cpu") -> PackedBatch:
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.zeros(len(sequences) + 1, dtype=torch.long)
    cu_seqlens[1:] = lengths.cumsum(0)
    input_ids = torch.tensor([token for s in sequences for token in s], dtype=torch.long)
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences])
    return PackedBatch(input_ids[None].to(device), position_ids[None].to(device), cu_seqlens.to(device),
                       [len(p) for p in prompts], [len(c) for c in completions])


def hidden_states(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """Final hidden states [L, H] of the packed row (model: a transformers causal LM or a PEFT wrapper)."""
    return packed_hidden_states(model, batch.input_ids, batch.cu_seqlens, batch.position_ids)


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM itself: a PEFT model's base model, or the model when it is no wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def completion_logprobs(model: torch.nn.Module, batch: PackedBatch, temperature: float = 1.0,
                        return_entropy: bool = False, entropy_grad: bool = True):
    """Per-token logprobs of each completion under softmax(logits / temperature), padded to
    [num_sequences, max_completion_length] fp32, with the matching mask (and entropy if asked;
    entropy_grad=False returns it detached, for logging, which spares the forward its gradient)."""
    causal_lm = causal_lm_of(model)
    positions = batch.completion_positions()
    targets = packed_targets(batch.input_ids[0], batch.cu_seqlens)[positions]
    hidden = hidden_states(model, batch)[positions]
    # Read after the forward: under full fine-tuning with FSDP, the weight the root gathered for it
    # (driver/distributed/fsdp.py), not the shard.
    result = token_logprobs(hidden, causal_lm.get_output_embeddings().weight, targets, temperature=temperature,
                            return_entropy=return_entropy, entropy_grad=entropy_grad)
    logprobs, entropy = result if return_entropy else (result, None)
    width = max(batch.completion_lengths, default=0)
    mask = torch.zeros(batch.num_sequences, width, device=logprobs.device)
    for row, length in enumerate(batch.completion_lengths):
        mask[row, :length] = 1.0
    flat_mask = mask.bool()

    def to_padded(values: torch.Tensor) -> torch.Tensor:
        padded = values.new_zeros(batch.num_sequences, width)
        return padded.masked_scatter(flat_mask, values)

    return to_padded(logprobs), (to_padded(entropy) if entropy is not None else None), mask
