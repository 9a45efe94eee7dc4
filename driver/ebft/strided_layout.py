"""Strided-mode row layout of EBFT (energy-based fine-tuning, arXiv 2603.12248): anchors, per-token
metadata, the block-parallel attention mask, position ids and the row that predicts each token.

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

    def _steps(self, steps: int | None) -> int:
        steps = self.generate_length if steps is None else steps
        if not 0 <= steps <= self.generate_length:
            raise ValueError(f"steps must be in [0, generate_length = {self.generate_length}], got {steps}")
        return steps

    def row_length(self, steps: int | None = None) -> int:
        """P + steps * NB: the row after `steps` generation steps (all G by default)."""
        return self.doc_length + self._steps(steps) * self.num_blocks()

    def token_meta(self, steps: int | None = None, segment: int = 0) -> TokenMeta:
        """Metadata of the row after `steps` generation steps (all G by default)."""
        steps, num_blocks, doc_length = self._steps(steps), self.num_blocks(), self.doc_length
        anchors = torch.tensor(self.anchors, dtype=torch.long)                  # [NB]
        step = torch.arange(steps).repeat_interleave(num_blocks)                 # [steps*NB] step-major
        block = torch.arange(num_blocks).repeat(steps)                           # [steps*NB]
        minus_one = torch.full((doc_length,), -1, dtype=torch.long)
        gen_anchor = anchors[block]
        return TokenMeta(
            segment=torch.full((doc_length + steps * num_blocks,), segment, dtype=torch.long),
            is_gen=torch.cat([torch.zeros(doc_length, dtype=torch.long), torch.ones_like(step)]),
            pos=torch.cat([torch.arange(doc_length), gen_anchor + step]),
            block=torch.cat([minus_one, block]),
            step=torch.cat([minus_one, step]),
            anchor=torch.cat([minus_one, gen_anchor]))

    def position_ids(self, steps: int | None = None) -> Tensor:
        """[L] position ids of the row."""
        return self.token_meta(steps).pos

    def generated_positions(self) -> Tensor:
        """[NB, G] row positions of block b's generated tokens, in step order."""
        num_blocks = self.num_blocks()
        steps = torch.arange(self.generate_length)
        return self.doc_length + steps[None, :] * num_blocks + torch.arange(num_blocks)[:, None]

    def predictor_positions(self) -> Tensor:
        """[NB*G] for each generated token in row order (step-major), the row whose logits predict it:
        a_b - 1 (the last context token) for step 0, the block's own previous token otherwise. The
        row just before a generated token belongs to another block, so the plain causal shift scores
        it with the wrong prediction (axolotl's strided logprob bug)."""
        rows = self.generated_positions()                                        # [NB, G]
        anchors = torch.tensor(self.anchors, dtype=torch.long)
        predictors = torch.cat([anchors[:, None] - 1, rows[:, :-1]], dim=1)      # [NB, G]
        return predictors.t().reshape(-1)                                        # step-major

    def ground_truth_spans(self) -> list[tuple[int, int]]:
        """(a_b, a_b + G) per block: the document span block b regenerates."""
        return [(anchor, anchor + self.generate_length) for anchor in self.anchors]


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


def pack_layouts(layouts: list[StridedLayout], steps: int | None = None) -> tuple[TokenMeta, list[int]]:
    """One row holding every layout (segment i = layouts[i]) and the row offset of each; a layout's
    row positions (predictor_positions, generated_positions) shift by its offset in the packed row.
    The n samples of a document are packed as n copies of its layout."""
    metas = [layout.token_meta(steps, segment=i) for i, layout in enumerate(layouts)]
    offsets = [0]
    for meta in metas[:-1]:
        offsets.append(offsets[-1] + len(meta))
    packed = TokenMeta(**{f.name: torch.cat([getattr(meta, f.name) for meta in metas]) for f in fields(TokenMeta)})
    return packed, offsets


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
