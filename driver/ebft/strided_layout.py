"""Strided-mode row layout of EBFT (energy-based fine-tuning, arXiv 2603.12248): anchors, the per-token
metadata (TokenMeta) and the block-parallel attention mask over it. The rows themselves, with their
position ids and the row that predicts each token, are built by driver/ebft/strided_generate.py
(generation_order), for many documents and samples at once.

One document x[0:P) is cut into NB blocks at anchors a_b = C + b*S (C = context_length = the first
anchor, S = stride). Block b regenerates the ground-truth span x[a_b : a_b + G) (G = generate_length)
with the whole prefix x[0:a_b) as its context: the contexts are nested prefixes, not a window of C
tokens (the official implementation and axolotl agree; the issue text and axolotl's docs describe a
window neither implements). All blocks are generated in one row, in parallel:

    row = x[0:P), then the generated tokens step-major: row position P + s*NB + b = step s of block b

Mask (True = attend), a function of the per-token metadata only (`attends`):
    document row t         -> document rows t' <= t (plain causal)
    generated row (s, b)   -> document rows t < a_b, and generated rows (s', b) with s' <= s
    never across segments (packed documents, or the n samples of a document, each with its own copy)
Position ids: document t -> t; generated (s, b) -> a_b + s, as if block b followed x[0:a_b) alone.

Backends (measured with transformers 5.19, which passes a 4-D mask through unchanged): SDPA takes the
bool `dense_mask`; eager needs `additive_mask` (a bool mask is silently wrong there); CUDA training
uses `create_block_mask(mask_mod(meta), ...)`. FlexAttention has no backward on CPU, and a float mask
through flex crashed the process, so CPU always uses the dense bool mask with SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch import Tensor


@dataclass
class TokenMeta:
    """Per-row metadata of a (packed) strided row; every field is a LongTensor [L].
    Document rows have block = step = anchor = -1."""
    segment: Tensor  # [L] document (or sample copy) the row belongs to; no attention across segments
    is_gen: Tensor   # [L] 1 for generated rows, 0 for document rows
    pos: Tensor      # [L] position id (document t -> t, generated (s, b) -> a_b + s)
    block: Tensor    # [L] block index b of generated rows
    step: Tensor     # [L] generation step s of generated rows
    anchor: Tensor   # [L] a_b of generated rows: they see document rows with pos < anchor

    def __len__(self) -> int:
        return self.pos.numel()

    def to(self, device: torch.device | str) -> TokenMeta:
        return TokenMeta(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class StridedLayout:
    """The strided layout of one document (one sample); see the module docstring."""
    doc_length: int        # P
    anchors: list[int]     # [NB] a_b = first anchor + b * stride
    generate_length: int   # G

    def num_blocks(self) -> int:
        return len(self.anchors)


def strided_layout(doc_length: int, stride: int, context_length: int, generate_length: int,
                   first_anchor_min: int = 0) -> StridedLayout:
    """Anchors C + b*S, b < NB = (P - G - C) // S + 1, with C = max(context_length, first_anchor_min)
    (prompt+answer documents pass prompt_len + min_completion_prefix as first_anchor_min).

    A document too short for one block (P < C + G) gives a layout with no blocks (the document alone),
    so the caller can count and drop it. Unlike the official code, (P - G - C) need not be a multiple
    of S: tokens after the last span are document rows only."""
    if stride < 1 or generate_length < 1 or context_length < 1:
        raise ValueError(f"stride, generate_length and context_length must be >= 1 (the first anchor needs "
                         f"a context token to predict it), got stride={stride}, "
                         f"generate_length={generate_length}, context_length={context_length}")
    if doc_length < 0:
        raise ValueError(f"doc_length must be >= 0, got {doc_length}")
    first_anchor = max(context_length, first_anchor_min)
    room = doc_length - generate_length - first_anchor
    num_blocks = room // stride + 1 if room >= 0 else 0
    return StridedLayout(doc_length, [first_anchor + b * stride for b in range(num_blocks)], generate_length)


def attends(meta: TokenMeta, q: Tensor, kv: Tensor) -> Tensor:
    """The strided mask predicate for (broadcastable) query and key row indices: True = attend."""
    is_gen_q, is_gen_kv = meta.is_gen[q] == 1, meta.is_gen[kv] == 1
    same_segment = meta.segment[q] == meta.segment[kv]
    doc_doc = ~is_gen_q & ~is_gen_kv & (meta.pos[kv] <= meta.pos[q])
    gen_context = is_gen_q & ~is_gen_kv & (meta.pos[kv] < meta.anchor[q])
    gen_gen = is_gen_q & is_gen_kv & (meta.block[q] == meta.block[kv]) & (meta.step[kv] <= meta.step[q])
    return same_segment & (doc_doc | gen_context | gen_gen)


def mask_mod(meta: TokenMeta) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """flex_attention mask_mod (for create_block_mask on CUDA; meta on the mask's device)."""
    def strided_mask_mod(batch: Tensor, head: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return attends(meta, q, kv)
    return strided_mask_mod


def dense_mask(meta: TokenMeta, q_slice: slice | None = None) -> Tensor:
    """[1, 1, Q, L] bool (True = attend) for the query rows q_slice (all by default) against every row
    in meta, e.g. the new rows of a KV-cache generation step. For SDPA; eager needs additive_mask."""
    rows = torch.arange(len(meta), device=meta.pos.device)
    queries = rows if q_slice is None else rows[q_slice]
    return attends(meta, queries[:, None], rows[None, :])[None, None]


def additive_mask(bool_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where bool_mask attends, finfo(dtype).min elsewhere: the mask the eager backend adds to scores."""
    return torch.zeros(bool_mask.shape, dtype=dtype, device=bool_mask.device).masked_fill(
        ~bool_mask, torch.finfo(dtype).min)
