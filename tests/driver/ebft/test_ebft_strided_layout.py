"""driver.ebft.strided_layout against oracles written as explicit loops over the layout's definition, and
against plain causal forwards of the tiny model, one block at a time."""

from dataclasses import fields

import pytest
import torch

from driver.ebft.strided_generate import generation_order
from driver.ebft.strided_layout import TokenMeta, additive_mask, dense_mask, mask_mod, strided_layout

# (doc_length P, stride S, context_length C, generate_length G, first_anchor_min) -> anchors
ANCHOR_CASES = [
    ((13, 2, 3, 3, 0), [3, 5, 7, 9]),
    ((15, 2, 3, 3, 0), [3, 5, 7, 9, 11]),         # (P - G - C) % S != 0: the last token is document only
    ((8, 4, 1, 7, 0), [1]),                     # exactly one block
    ((7, 4, 1, 7, 0), []),                      # too short for one block: document alone
    ((13, 2, 3, 3, 6), [6, 8, 10]),             # prompt+answer document: first anchor after the prompt
    ((13, 2, 3, 3, 11), []),
    ((40, 1, 5, 1, 0), list(range(5, 40))),
]
# (P, S, C, G) of the mask oracles, odd sizes included
MASK_CASES = [(13, 2, 3, 3), (9, 4, 1, 1), (23, 3, 5, 4), (6, 1, 2, 5)]


# One layout's row, written out by the module docstring's definition: the driver builds the shared
# row of many documents and samples instead (driver/ebft/strided_generate.py: generation_order).
def checked_steps(layout, steps):
    steps = layout.generate_length if steps is None else steps
    if not 0 <= steps <= layout.generate_length:
        raise ValueError(f"steps must be in [0, generate_length = {layout.generate_length}], got {steps}")
    return steps


def token_meta(layout, steps=None, segment=0):
    """Metadata of the row after `steps` generation steps (all G by default)."""
    steps, num_blocks, doc_length = checked_steps(layout, steps), layout.num_blocks(), layout.doc_length
    anchors = torch.tensor(layout.anchors, dtype=torch.long)                # [NB]
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


def position_ids(layout, steps=None):
    return token_meta(layout, steps).pos


def generated_positions(layout):
    """[NB, G] row positions of block b's generated tokens, in step order."""
    num_blocks = layout.num_blocks()
    steps = torch.arange(layout.generate_length)
    return layout.doc_length + steps[None, :] * num_blocks + torch.arange(num_blocks)[:, None]


def row_length(layout, steps=None):
    """P + steps * NB: the row after `steps` generation steps (all G by default)."""
    return layout.doc_length + checked_steps(layout, steps) * layout.num_blocks()


def predictor_positions(layout):
    """[NB*G] for each generated token in row order (step-major), the row whose logits predict it:
    a_b - 1 (the last context token) for step 0, the block's own previous token otherwise. The row
    just before a generated token belongs to another block, so the plain causal shift scores it
    with the wrong prediction (axolotl's strided logprob bug)."""
    rows = generated_positions(layout)                                        # [NB, G]
    anchors = torch.tensor(layout.anchors, dtype=torch.long)
    predictors = torch.cat([anchors[:, None] - 1, rows[:, :-1]], dim=1)        # [NB, G]
    return predictors.t().reshape(-1)                                          # step-major


def ground_truth_spans(layout):
    """(a_b, a_b + G) per block: the document span block b regenerates."""
    return [(anchor, anchor + layout.generate_length) for anchor in layout.anchors]


def pack_layouts(layouts, steps=None):
    """One row holding every layout (segment i = layouts[i]) and the row offset of each: the n
    samples of a document packed as n copies of its layout."""
    metas = [token_meta(layout, steps, segment=i) for i, layout in enumerate(layouts)]
    offsets = [0]
    for meta in metas[:-1]:
        offsets.append(offsets[-1] + len(meta))
    packed = TokenMeta(**{f.name: torch.cat([getattr(meta, f.name) for meta in metas]) for f in fields(TokenMeta)})
    return packed, offsets


def oracle_rows(P, anchors, G):
    """Row descriptors in row order, by the layout's definition: ('doc', t) then ('gen', s, b) step-major."""
    rows = [("doc", t) for t in range(P)]
    for s in range(G):
        for b in range(len(anchors)):
            rows.append(("gen", s, b))
    return rows


def oracle_mask(P, anchors, G):
    """The mask rule applied literally to every (query, key) pair."""
    rows = oracle_rows(P, anchors, G)
    mask = torch.zeros(len(rows), len(rows), dtype=torch.bool)
    for i, query in enumerate(rows):
        for j, key in enumerate(rows):
            if query[0] == "doc":
                mask[i, j] = key[0] == "doc" and key[1] <= query[1]
            elif key[0] == "doc":
                mask[i, j] = key[1] < anchors[query[2]]
            else:
                mask[i, j] = key[2] == query[2] and key[1] <= query[1]
    return mask


def layout_of(P, S, C, G):
    return strided_layout(P, stride=S, context_length=C, generate_length=G)


@pytest.mark.parametrize("args, anchors", ANCHOR_CASES)
def test_anchors_start_at_the_first_anchor_and_fit_every_span_in_the_document(args, anchors):
    P, S, C, G, first_anchor_min = args
    layout = strided_layout(P, S, C, G, first_anchor_min=first_anchor_min)
    assert layout.anchors == anchors
    assert layout.num_blocks() == len(anchors)
    assert ground_truth_spans(layout) == [(a, a + G) for a in anchors]
    assert row_length(layout) == P + G * len(anchors)


def test_a_document_too_short_for_one_block_is_the_document_alone():
    layout = strided_layout(5, stride=2, context_length=3, generate_length=3)
    assert layout.num_blocks() == 0
    assert predictor_positions(layout).numel() == 0
    assert torch.equal(dense_mask(token_meta(layout))[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("bad", [dict(stride=0), dict(context_length=0), dict(generate_length=0)])
def test_a_zero_stride_context_or_generate_length_is_rejected(bad):
    args = dict(stride=2, context_length=3, generate_length=3) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        strided_layout(13, **args)


def test_rows_positions_and_predictors_match_a_hand_written_loop():
    P, S, C, G = 13, 2, 3, 3
    layout = layout_of(P, S, C, G)
    anchors = layout.anchors
    NB = len(anchors)
    rows, positions, predictors = [[None] * G for _ in range(NB)], list(range(P)), []
    for s in range(G):
        for b in range(NB):
            rows[b][s] = P + s * NB + b
            positions.append(anchors[b] + s)
            predictors.append(anchors[b] - 1 if s == 0 else P + (s - 1) * NB + b)
    assert generated_positions(layout).tolist() == rows
    assert position_ids(layout).tolist() == positions
    assert predictor_positions(layout).tolist() == predictors
    meta = token_meta(layout)
    assert meta.is_gen.tolist() == [0] * P + [1] * (G * NB)
    assert meta.step.tolist() == [-1] * P + [s for s in range(G) for _ in range(NB)]
    assert meta.block.tolist() == [-1] * P + [b for _ in range(G) for b in range(NB)]
    assert meta.anchor.tolist() == [-1] * P + [anchors[b] for _ in range(G) for b in range(NB)]


def test_the_row_after_some_steps_is_a_prefix_of_the_full_row():
    layout = layout_of(13, 2, 3, 3)
    full = token_meta(layout)
    for steps in range(4):
        partial = token_meta(layout, steps)
        assert len(partial) == row_length(layout, steps) == 13 + 4 * steps
        assert torch.equal(partial.pos, full.pos[:len(partial)])
        assert torch.equal(dense_mask(partial), dense_mask(full)[..., :len(partial), :len(partial)])
    with pytest.raises(ValueError, match="steps must be in"):  # the driver's row builder checks too
        generation_order([layout], num_samples=1, steps=4)


@pytest.mark.parametrize("P, S, C, G", MASK_CASES)
def test_dense_mask_is_the_rule_applied_to_every_pair(P, S, C, G):
    layout = layout_of(P, S, C, G)
    expected = oracle_mask(P, layout.anchors, G)
    mask = dense_mask(token_meta(layout))
    assert mask.shape == (1, 1, *expected.shape) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], expected)
    assert torch.equal(dense_mask(token_meta(layout), slice(P, None))[0, 0], expected[P:])


@pytest.mark.parametrize("P, S, C, G", MASK_CASES)
def test_a_block_sees_only_its_prefix_and_its_own_earlier_tokens(P, S, C, G):
    layout = layout_of(P, S, C, G)
    mask = dense_mask(token_meta(layout))[0, 0]
    rows = generated_positions(layout)                                     # [NB, G]
    for b, anchor in enumerate(layout.anchors):
        for s in range(G):
            row = mask[rows[b, s]]
            assert row[:anchor].all() and not row[anchor:P].any()
            others = torch.cat([rows[:b], rows[b + 1:]]).flatten()
            assert not row[others].any()
            assert row[rows[b, :s + 1]].all() and not row[rows[b, s + 1:]].any()


def test_packed_layouts_never_attend_across_segments():
    layouts = [layout_of(13, 2, 3, 3), layout_of(9, 4, 1, 1), layout_of(5, 2, 3, 3), layout_of(13, 2, 3, 3)]
    meta, offsets = pack_layouts(layouts)
    mask = dense_mask(meta)[0, 0]
    expected = torch.block_diag(*[oracle_mask(layout.doc_length, layout.anchors, layout.generate_length)
                                  for layout in layouts])
    assert torch.equal(mask, expected)
    assert offsets == [0, 25, 36, 41]  # rows 13 + 3*4, 9 + 1*2, 5 (no block)
    assert meta.segment.tolist() == [i for i, layout in enumerate(layouts) for _ in range(row_length(layout))]
    assert torch.equal(meta.pos, torch.cat([position_ids(layout) for layout in layouts]))


@pytest.mark.parametrize("P, S, C, G", MASK_CASES)
def test_flex_mask_mod_gives_the_dense_mask(P, S, C, G):
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="flex_attention unavailable")
    meta, _ = pack_layouts([layout_of(P, S, C, G), layout_of(13, 2, 3, 3)])
    L = len(meta)
    assert torch.equal(flex.create_mask(mask_mod(meta), None, None, L, L, device="cpu"), dense_mask(meta))


def test_additive_mask_is_zero_where_attended_and_the_dtype_minimum_elsewhere():
    mask = dense_mask(token_meta(layout_of(13, 2, 3, 3)))
    additive = additive_mask(mask, torch.bfloat16)
    assert additive.dtype == torch.bfloat16
    assert torch.equal(additive == 0, mask)
    assert (additive[~mask] == torch.finfo(torch.bfloat16).min).all()


# ---- the layout through the tiny model -------------------------------------------------------------

MODEL_LAYOUT = (29, 4, 5, 4)  # P, S, C, G -> anchors 5, 9, 13, 17, 21, 25 (the last span ends at P)


@pytest.fixture(scope="module")
def causal_lm():
    from driver.config import Config
    from driver.policy.model import load_policy

    model = load_policy(Config.model_validate({"lora": {"r": 4}})).causal_lm
    return model.eval()


def random_tokens(n, seed):
    return torch.randint(10, 300, (n,), generator=torch.Generator().manual_seed(seed))


def strided_row(layout, document, generated):
    """[L] token ids: the document, then generated [NB, G] step-major."""
    return torch.cat([document, generated.t().reshape(-1)])


@torch.no_grad()
def strided_logits(model, layout, tokens, mask=None):
    meta = token_meta(layout)
    mask = dense_mask(meta) if mask is None else mask
    return model(input_ids=tokens[None], attention_mask=mask, position_ids=meta.pos[None]).logits[0]


@torch.no_grad()
def block_logits(model, document, anchor, block_tokens):
    """Plain causal forward of x[:a_b] + the block's tokens: [a_b + G, V]."""
    return model(input_ids=torch.cat([document[:anchor], block_tokens])[None]).logits[0]


def test_each_block_computes_what_a_causal_forward_of_its_prefix_and_its_tokens_computes(causal_lm):
    layout = layout_of(*MODEL_LAYOUT)
    document, generated = random_tokens(layout.doc_length, 0), random_tokens(layout.num_blocks() * 4, 1).view(-1, 4)
    logits = strided_logits(causal_lm, layout, strided_row(layout, document, generated))
    rows = generated_positions(layout)
    for b, anchor in enumerate(layout.anchors):
        alone = block_logits(causal_lm, document, anchor, generated[b])
        torch.testing.assert_close(logits[rows[b]], alone[anchor:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[:layout.doc_length], causal_lm(input_ids=document[None]).logits[0].detach(),
                               atol=1e-4, rtol=1e-4)


def test_changing_another_blocks_tokens_leaves_a_block_unchanged(causal_lm):
    layout = layout_of(*MODEL_LAYOUT)
    document, generated = random_tokens(layout.doc_length, 0), random_tokens(layout.num_blocks() * 4, 1).view(-1, 4)
    before = strided_logits(causal_lm, layout, strided_row(layout, document, generated))
    changed = generated.clone()
    changed[1:] = random_tokens(changed[1:].numel(), 2).view_as(changed[1:])
    after = strided_logits(causal_lm, layout, strided_row(layout, document, changed))
    rows = generated_positions(layout)
    assert torch.equal(before[rows[0]], after[rows[0]])
    assert torch.equal(before[:layout.doc_length], after[:layout.doc_length])
    assert not torch.allclose(before[rows[1]], after[rows[1]])


def test_predictor_rows_give_each_generated_token_its_own_blocks_next_token_distribution(causal_lm):
    layout = layout_of(*MODEL_LAYOUT)
    G = layout.generate_length
    document, generated = random_tokens(layout.doc_length, 3), random_tokens(layout.num_blocks() * G, 4).view(-1, G)
    logits = strided_logits(causal_lm, layout, strided_row(layout, document, generated))
    gathered = logits[predictor_positions(layout)].view(G, layout.num_blocks(), -1)     # [G, NB, V] step-major
    shifted = logits[generated_positions(layout).t().reshape(-1) - 1].view_as(gathered)  # the plain causal shift
    for b, anchor in enumerate(layout.anchors):
        alone = block_logits(causal_lm, document, anchor, generated[b])[anchor - 1:anchor - 1 + G]
        torch.testing.assert_close(gathered[:, b].log_softmax(-1), alone.log_softmax(-1), atol=1e-4, rtol=1e-4)
        if b > 0:  # the previous row belongs to another block: a different distribution
            assert not torch.allclose(shifted[:, b], alone, atol=1e-2)


def test_packed_documents_compute_what_each_computes_alone(causal_lm):
    layouts = [layout_of(*MODEL_LAYOUT), layout_of(13, 2, 3, 3)]
    rows = [strided_row(layout, random_tokens(layout.doc_length, 5 + i),
                        random_tokens(layout.num_blocks() * layout.generate_length, 7 + i)
                        .view(layout.num_blocks(), -1))
            for i, layout in enumerate(layouts)]
    meta, offsets = pack_layouts(layouts)
    with torch.no_grad():
        packed = causal_lm(input_ids=torch.cat(rows)[None], attention_mask=dense_mask(meta),
                           position_ids=meta.pos[None]).logits[0]
    for layout, row, offset in zip(layouts, rows, offsets):
        torch.testing.assert_close(packed[offset:offset + len(row)], strided_logits(causal_lm, layout, row),
                                   atol=1e-4, rtol=1e-4)


def test_eager_attention_with_the_additive_mask_matches_sdpa_with_the_bool_mask(causal_lm):
    layout = layout_of(*MODEL_LAYOUT)
    tokens = strided_row(layout, random_tokens(layout.doc_length, 0),
                         random_tokens(layout.num_blocks() * 4, 1).view(-1, 4))
    sdpa = strided_logits(causal_lm, layout, tokens)
    causal_lm.set_attn_implementation("eager")
    try:
        eager = strided_logits(causal_lm, layout, tokens, additive_mask(dense_mask(token_meta(layout)), torch.float32))
    finally:
        causal_lm.set_attn_implementation("sdpa")
    torch.testing.assert_close(eager, sdpa, atol=1e-4, rtol=1e-4)

