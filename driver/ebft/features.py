"""EBFT features: the frozen base network's hidden states, normalized per token and pooled per sequence.

The feature map phi(c, y) of EBFT (Jelassi et al. 2026, https://arxiv.org/abs/2603.12248) is read from
a few intermediate layers of the *initial* network: for a LoRA policy, the same model with the adapter
disabled (the caller enters `policy.reference()`; the adapter must never be merged into the base, or
the "frozen" features drift).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from driver.policy.logprobs import causal_lm_of

POOL_METHODS = ("last_token", "mean_pooling", "completion_mean", "concat")
CONCAT_QUARTERS = (1, 2, 3)  # `concat` reads the completion at 25 / 50 / 75 % of its length


def quarter_offsets(length: int) -> list[int]:
    """Offsets floor(length * q / 4), q = 1, 2, 3, into a span of `length` >= 1 tokens (always inside
    it): the positions axolotl's `concat` reads (valid_lens // 4, // 2, 3 * valid_lens // 4)."""
    return [length * quarter // 4 for quarter in CONCAT_QUARTERS]


def concat_tokens(features: torch.Tensor) -> torch.Tensor:  # [..., 3, F] -> [..., 3F]
    """The quarter tokens side by side, divided by sqrt(3): unit token features stay a unit vector, so
    the diversity dot products keep the scale of the other methods (axolotl normalizes its pooled
    vector to unit length in structured mode)."""
    return features.flatten(-2) / math.sqrt(len(CONCAT_QUARTERS))


def layer_indices(num_layers: int, fractions: list[float]) -> list[int]:
    """Fractions of depth -> indices into transformers' `output_hidden_states` tuple.

    Index 0 of that tuple is the embeddings and i the output of decoder layer i. The mapping is the
    official code's `clamp(floor(f * L), 1, L)`, so the embeddings are never chosen (axolotl's
    `int(f * L)` picks them for f = 0.25 on a 2-layer model).
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not fractions:
        raise ValueError("fractions must name at least one layer, got []")
    bad = [f for f in fractions if not 0.0 < f <= 1.0]
    if bad:
        raise ValueError(f"fractions must lie in (0, 1], got {bad}")
    return [min(max(math.floor(f * num_layers), 1), num_layers) for f in fractions]


def token_features(states: list[torch.Tensor]) -> torch.Tensor:  # states: k x [L, H] -> [L, k * H]
    """Per token: L2-normalize each layer's vector, concatenate, divide by sqrt(k).

    Every layer weighs the same whatever its scale (axolotl's documented "L2-normalized per layer before
    concatenation"), and each token's feature is a unit vector, so the diversity dot products lie in
    [-1, 1] whatever the number of layers, as in the official code (which normalizes the concatenation)
    and axolotl's structured mode (which normalizes the pooled vector). axolotl's strided mode skips the
    1 / sqrt(k): the same features scaled by sqrt(k), cosines unchanged, dot products k times larger.
    """
    if not states:
        raise ValueError("states must hold at least one layer, got []")
    normalized = [F.normalize(state, dim=-1) for state in states]
    return torch.cat(normalized, dim=-1) / math.sqrt(len(states))


@torch.no_grad()
def hidden_layer_states(
    model: nn.Module,  # causal LM, or a PEFT model wrapping one
    input_ids: torch.Tensor,  # [1, L]
    position_ids: torch.Tensor | None,  # [1, L]
    attention_mask: torch.Tensor | None,  # [1, L] padding mask, or a 4-D mask for packed rows
    layers: list[int],  # indices into the hidden-states tuple (see layer_indices)
    **attention_kwargs,  # e.g. cu_seq_lens_q/k for flash attention (pykernels' packed_attention_kwargs)
) -> list[torch.Tensor]:  # len(layers) x [L, H]
    """One forward of the LM's body (no lm_head) returning the requested hidden states of the row.

    Runs whatever weights are active: the caller passes the frozen base (what `policy.reference()` yields: the
    model with its adapter disabled, or the frozen copy under full fine-tuning) in eval mode.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, L), got {tuple(input_ids.shape)}")
    causal_lm = causal_lm_of(model)
    body = causal_lm.get_decoder()
    outputs = body(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                   output_hidden_states=True, use_cache=False, **attention_kwargs)
    hidden_states = outputs.hidden_states  # (embeddings, layer 1, ..., layer N); the last is post-norm
    bad = [i for i in layers if not 0 <= i < len(hidden_states)]
    if bad:
        raise ValueError(f"layers must lie in [0, {len(hidden_states) - 1}], got {bad}")
    return [hidden_states[i][0] for i in layers]


def pool(
    features: torch.Tensor,  # [L, F] token features of one row
    spans: list[tuple[int, int, int]],  # N x (sequence_start, completion_start, end) in the row
    method: str,
) -> torch.Tensor:  # [N, F], or [N, 3F] for "concat"
    """One vector per sequence.

    - "last_token": the sequence's last token.
    - "mean_pooling": mean over the whole sequence, prompt included (axolotl's structured mode).
    - "completion_mean": mean over the completion only.
    - "concat": the completion's tokens at 25 / 50 / 75 % of its length, concatenated (concat_tokens).
      Unlike axolotl, whose quartiles are of prompt + completion (with a long prompt all three fall in
      the prompt and every sample of a group gets the same features), only the completion is read.

    An empty completion (completion_start == end) is represented by the last prompt token in every
    method but "mean_pooling" (three copies of it for "concat"), so such a sample still gets a
    defined feature rather than a NaN mean.
    """
    if method not in POOL_METHODS:
        raise ValueError(f"method must be one of {list(POOL_METHODS)}, got {method!r}")
    length = features.shape[0]
    pooled = []
    for sequence_start, completion_start, end in spans:
        if not 0 <= sequence_start <= completion_start <= end <= length or sequence_start == end:
            raise ValueError(f"span (sequence_start, completion_start, end) must satisfy "
                             f"0 <= sequence_start <= completion_start <= end <= {length} and a "
                             f"non-empty sequence, got {(sequence_start, completion_start, end)}")
        completion_length = end - completion_start
        if method == "mean_pooling":
            pooled.append(features[sequence_start:end].mean(dim=0))
        elif method == "last_token" or completion_length == 0:
            last = features[end - 1]
            pooled.append(concat_tokens(last.expand(len(CONCAT_QUARTERS), -1)) if method == "concat" else last)
        elif method == "completion_mean":
            pooled.append(features[completion_start:end].mean(dim=0))
        else:
            positions = [completion_start + offset for offset in quarter_offsets(completion_length)]
            pooled.append(concat_tokens(features[positions]))
    return torch.stack(pooled)
