"""Strided-mode generation of EBFT (arXiv 2603.12248): every block of every sample of every document
sampled in one row, step after step, with a KV cache (or, as the reference, a full forward per step).

The row is in *generation order*; the n samples of a document share one copy of it (the official code
repeats the document n times):

    row = the document rows of documents 0..D-1 (document d = segment d)
          then step 0 of every unit, step 1 of every unit, ..., step G-1
    unit = (document d, sample j, block b), in that order; its block id in segment d is j*NB_d + b

so `attends` of strided_layout gives the mask unchanged: a unit sees its document's rows before a_b and
its own earlier steps, never another block or sample. The row after s steps is a prefix of the full
row, which is what lets a KV-cache step append only the new rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from driver.ebft.strided_layout import StridedLayout, TokenMeta, additive_mask, attends, dense_mask
from driver.policy.model import evaluating

if TYPE_CHECKING:
    from transformers import DynamicCache


def sample_tokens(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draw one token per row of logits [N, V] from softmax(logits / temperature) restricted to the top_k
    tokens (-1 = off; ties with the k-th are kept, as in vLLM), then to the nucleus (the smallest set of
    the most likely tokens whose renormalized probability reaches top_p; 1.0 = off).

    Returns (tokens [N] long, logprobs [N] float32). The logprob is of the FULL tempered distribution,
    before top-k/top-p: the strided update takes it as the old policy's logprob, which the trainer
    scores the same way (so the first update's ratio is 1). vLLM's processed logprobs, which the
    structured path stores, are AFTER top-k/top-p (of the truncated distribution it sampled from)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (use top_k=1 for greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k != -1 and top_k < 1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    tempered = logits.float() / temperature                                  # [N, V]
    allowed = tempered
    if 0 < top_k < tempered.shape[-1]:
        kth = tempered.topk(top_k, dim=-1).values[:, -1:]                    # [N, 1]
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = allowed.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the more likely ones already reach top_p; the top token has 0 before it.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        allowed = allowed.masked_fill(drop, float("-inf"))
    tokens = torch.multinomial(allowed.softmax(-1), 1, generator=generator).squeeze(-1)
    logprobs = tempered.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


@dataclass
class GenerationOrder:
    """The generation-order row of some documents after `steps` steps, and where each token lies in it."""
    meta: TokenMeta                # [L]
    doc_rows: list[Tensor]         # per document: [P_d] rows of its document tokens
    gen_rows: list[Tensor]         # per document: [n, NB_d, steps] row of (sample, block, step)
    predictor_rows: list[Tensor]   # per document: [n, NB_d, steps] the row whose logits predict that token


def generation_order(layouts: list[StridedLayout], num_samples: int, steps: int | None = None) -> GenerationOrder:
    """The row (see the module docstring) after `steps` generation steps (all G by default)."""
    if not layouts:
        raise ValueError("layouts must hold at least one document's layout")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    generate_lengths = sorted({layout.generate_length for layout in layouts})
    if len(generate_lengths) > 1:
        raise ValueError(f"every layout must have the same generate_length (one row, one step loop), "
                         f"got {generate_lengths}")
    steps = layouts[0].generate_length if steps is None else steps
    if not 0 <= steps <= layouts[0].generate_length:
        raise ValueError(f"steps must be in [0, generate_length = {layouts[0].generate_length}], got {steps}")
    n, long = num_samples, dict(dtype=torch.long)
    doc_lengths = torch.tensor([layout.doc_length for layout in layouts], **long)
    doc_offsets = doc_lengths.cumsum(0) - doc_lengths
    units_per_doc = torch.tensor([n * layout.num_blocks() for layout in layouts], **long)
    unit_offsets = units_per_doc.cumsum(0) - units_per_doc
    num_doc_rows, num_units = int(doc_lengths.sum()), int(units_per_doc.sum())
    # Per unit, in (document, sample, block) order: its segment, block id and anchor.
    unit_segment = torch.arange(len(layouts)).repeat_interleave(units_per_doc)
    unit_block = torch.cat([torch.arange(int(count)) for count in units_per_doc])
    unit_anchor = torch.cat([torch.tensor(layout.anchors, **long).repeat(n) for layout in layouts])
    step = torch.arange(steps).repeat_interleave(num_units)                   # [steps * U] step-major
    gen_anchor, minus_one = unit_anchor.repeat(steps), torch.full((num_doc_rows,), -1, **long)
    meta = TokenMeta(
        segment=torch.cat([torch.arange(len(layouts)).repeat_interleave(doc_lengths), unit_segment.repeat(steps)]),
        is_gen=torch.cat([torch.zeros(num_doc_rows, **long), torch.ones_like(step)]),
        pos=torch.cat([torch.cat([torch.arange(int(p)) for p in doc_lengths]), gen_anchor + step]),
        block=torch.cat([minus_one, unit_block.repeat(steps)]),
        step=torch.cat([minus_one, step]),
        anchor=torch.cat([minus_one, gen_anchor]))
    doc_rows, gen_rows, predictor_rows = [], [], []
    for layout, doc_offset, unit_offset in zip(layouts, doc_offsets.tolist(), unit_offsets.tolist()):
        num_blocks = layout.num_blocks()
        units = unit_offset + torch.arange(n * num_blocks).view(n, num_blocks, 1)
        rows = num_doc_rows + torch.arange(steps) * num_units + units                     # [n, NB, steps]
        first = (doc_offset + torch.tensor(layout.anchors, **long) - 1).expand(n, num_blocks)[..., None]
        doc_rows.append(doc_offset + torch.arange(layout.doc_length))
        gen_rows.append(rows)
        predictor_rows.append(torch.cat([first, rows[..., :-1]], dim=-1)[..., :steps])
    return GenerationOrder(meta, doc_rows, gen_rows, predictor_rows)


@dataclass
class StridedRollout:
    """Sampled blocks of every (document, sample) and the full generation-order row holding them (CPU)."""
    input_ids: Tensor                # [L] the full row in generation order (all G steps)
    meta: TokenMeta                  # [L] its metadata
    doc_rows: list[Tensor]           # per document: [P_d] row indices of its document tokens
    gen_rows: list[Tensor]           # per document: [n, NB_d, G] row of the token of (sample, block, step)
    predictor_rows: list[Tensor]     # per document: [n, NB_d, G] the row whose logits predicted that token:
                                     # document row a_b - 1 for step 0, the same unit's step s-1 row otherwise
    tokens: list[Tensor]             # per document: [n, NB_d, G] sampled token ids
    sampling_logprobs: list[Tensor]  # per document: [n, NB_d, G] float32, from sample_tokens
    num_samples: int


def row_inputs(rollout: StridedRollout, device: torch.device | str,
               additive_mask_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids [1, L], position_ids [1, L], attention_mask [1, 1, L, L]) of one forward of the full row:
    the bool mask (SDPA), or the additive mask of additive_mask_dtype (the eager backend needs it)."""
    meta = rollout.meta.to(device)
    mask = dense_mask(meta)
    mask = mask if additive_mask_dtype is None else additive_mask(mask, additive_mask_dtype)
    return rollout.input_ids.to(device)[None], meta.pos[None], mask


@torch.no_grad()
def sample_strided(model: nn.Module, documents: list[list[int]], layouts: list[StridedLayout], num_samples: int,
                   *, temperature: float, top_p: float = 1.0, top_k: int = -1,
                   generator: torch.Generator | None = None, kv_cache: bool = True,
                   additive_mask_dtype: torch.dtype | None = None) -> StridedRollout:
    """Sample num_samples generations of every block of every document with the model's active weights
    (the caller turns an adapter on or off), in eval mode, on the model's device. Documents longer than
    their layout's doc_length are cut to it. kv_cache=False recomputes the whole row every step (the
    reference); both draw the same tokens from the same generator: the same [U, V] draws in the same order."""
    if len(documents) != len(layouts):
        raise ValueError(f"documents and layouts must pair up, got {len(documents)} documents and "
                         f"{len(layouts)} layouts")
    for d, (document, layout) in enumerate(zip(documents, layouts)):
        if len(document) < layout.doc_length:
            raise ValueError(f"documents[{d}] has {len(document)} tokens, shorter than its layout's "
                             f"doc_length {layout.doc_length}")
    order = generation_order(layouts, num_samples)
    generate_length, device = layouts[0].generate_length, next(model.parameters()).device
    num_doc_rows = sum(layout.doc_length for layout in layouts)
    num_units = (len(order.meta) - num_doc_rows) // generate_length
    input_ids = torch.zeros(len(order.meta), dtype=torch.long)
    input_ids[:num_doc_rows] = torch.tensor(
        [token for document, layout in zip(documents, layouts) for token in document[:layout.doc_length]],
        dtype=torch.long)
    # [G, U]: the predictor row of every unit at each step, in unit order.
    step_predictors = torch.cat([rows.reshape(-1, generate_length) for rows in order.predictor_rows]).t()
    tokens = torch.zeros(generate_length, num_units, dtype=torch.long)
    logprobs = torch.zeros(generate_length, num_units, dtype=torch.float32)
    if num_units > 0:
        with evaluating(model):
            from transformers import DynamicCache

            # No config: a config-built cache may hold sliding-window layers, which crop by row index,
            # while this row's order is not its positions; the 4-D mask alone says who sees whom.
            cache = DynamicCache() if kv_cache else None
            meta, row_ids = order.meta.to(device), input_ids.to(device)
            for step in range(generate_length):
                known_rows = num_doc_rows + step * num_units
                # Uncached rows: the documents at step 0 (prefill), then the previous step's tokens.
                first_new = known_rows - num_units if kv_cache and step > 0 else 0
                logits = _step_logits(model, row_ids, meta, first_new, known_rows,
                                      step_predictors[step].to(device), cache, additive_mask_dtype)
                step_tokens, step_logprobs = sample_tokens(logits, temperature, top_p, top_k, generator)
                new_rows = slice(num_doc_rows + step * num_units, num_doc_rows + (step + 1) * num_units)
                row_ids[new_rows] = step_tokens
                tokens[step], logprobs[step] = step_tokens.cpu(), step_logprobs.cpu()
        input_ids = row_ids.cpu()
    units_per_doc = [num_samples * layout.num_blocks() for layout in layouts]
    shapes = [(num_samples, layout.num_blocks(), generate_length) for layout in layouts]
    return StridedRollout(
        input_ids=input_ids, meta=order.meta, doc_rows=order.doc_rows, gen_rows=order.gen_rows,
        predictor_rows=order.predictor_rows,
        tokens=[part.reshape(shape) for part, shape in zip(tokens.t().split(units_per_doc), shapes)],
        sampling_logprobs=[part.reshape(shape) for part, shape in zip(logprobs.t().split(units_per_doc), shapes)],
        num_samples=num_samples)


def _step_logits(model: nn.Module, row_ids: Tensor, meta: TokenMeta, first_new: int, known_rows: int,
                 predictors: Tensor, cache: DynamicCache | None, additive_mask_dtype: torch.dtype | None) -> Tensor:
    """[U, V] logits predicting the next step of every unit, from a forward of the rows
    [first_new, known_rows) against the keys [0, known_rows) (the rows before first_new are in the cache).
    predictors [U] are rows of the full row."""
    new_rows = torch.arange(first_new, known_rows, device=row_ids.device)
    keys = torch.arange(known_rows, device=row_ids.device)
    mask = attends(meta, new_rows[:, None], keys[None, :])[None, None]          # [1, 1, new, known]
    mask = mask if additive_mask_dtype is None else additive_mask(mask, additive_mask_dtype)
    out = model(input_ids=row_ids[None, first_new:known_rows], position_ids=meta.pos[None, first_new:known_rows],
                attention_mask=mask, past_key_values=cache, use_cache=cache is not None,
                logits_to_keep=predictors - first_new)  # only the predicting rows: no [L, V] logits
    return out.logits[0]
