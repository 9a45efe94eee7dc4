"""driver.ebft.strided_generate against oracles: a per-row sorting loop for the sampler, an explicit loop over
row descriptors for the generation-order mask, and plain causal forwards / greedy loops of the tiny model
(one block at a time) for the generations and their logprobs."""

import pytest
import torch

from driver.ebft.strided_generate import generation_order, row_inputs, sample_strided, sample_tokens
from driver.ebft.strided_layout import dense_mask, strided_layout

# (temperature, top_p, top_k) of the sampler oracles
SAMPLER_CASES = [(1.0, 1.0, -1), (0.7, 0.9, -1), (1.3, 1.0, 5), (1.0, 0.5, 7), (0.5, 0.8, 3), (2.0, 0.3, -1)]
ROWS, VOCAB, DRAWS = 3, 11, 4000
# (P, S, C, G) per document: anchors [4, 7, 10, 13], [5, 7], [] (too short: document rows only)
DOC_SHAPES = [(17, 3, 4, 3), (11, 2, 5, 3), (6, 2, 5, 3)]


def allowed_distribution(logits_row, temperature, top_p, top_k):
    """{token: renormalized probability} by the definition: rank tokens by probability, keep the first top_k,
    renormalize, keep the smallest prefix whose mass reaches top_p, renormalize."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda token: -probs[token])
    if top_k != -1:
        ranked = ranked[:top_k]
    total = sum(probs[token] for token in ranked)
    kept, mass = [], 0.0
    for token in ranked:
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token] / total
    kept_total = sum(probs[token] for token in kept)
    return {token: probs[token] / kept_total for token in kept}


@pytest.mark.parametrize("temperature, top_p, top_k", SAMPLER_CASES)
def test_sampled_frequencies_follow_the_truncated_distribution(temperature, top_p, top_k):
    logits = torch.randn(VOCAB, ROWS, generator=torch.Generator().manual_seed(0)).mul(2).t()  # non-contiguous
    tokens, logprobs = sample_tokens(logits.repeat(DRAWS, 1), temperature, top_p, top_k,
                                     torch.Generator().manual_seed(1))
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32 and tokens.shape == (ROWS * DRAWS,)
    full = torch.log_softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(logprobs.double(), full.repeat(DRAWS, 1).gather(-1, tokens[:, None])[:, 0],
                               atol=1e-5, rtol=1e-5)
    for row in range(ROWS):
        expected = allowed_distribution(logits[row], temperature, top_p, top_k)
        drawn = tokens.view(DRAWS, ROWS)[:, row]
        assert set(drawn.tolist()) <= set(expected)
        frequencies = torch.bincount(drawn, minlength=VOCAB).double() / DRAWS
        for token in range(VOCAB):
            assert abs(frequencies[token].item() - expected.get(token, 0.0)) < 0.03


def test_a_tiny_temperature_or_top_k_1_is_greedy():
    logits = torch.randn(7, 83, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample_tokens(logits, 1e-4)[0], logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, 5.0, top_k=1)[0], logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, 5.0, top_p=1e-6)[0], logits.argmax(-1))


@pytest.mark.parametrize("bad, name", [(dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                       (dict(top_k=0), "top_k")])
def test_bad_sampling_parameters_are_rejected(bad, name):
    with pytest.raises(ValueError, match=name):
        sample_tokens(torch.zeros(2, 5), **(dict(temperature=1.0) | bad))


# ---- the generation-order row -------------------------------------------------------------------------

def layouts_of(shapes):
    return [strided_layout(P, stride=S, context_length=C, generate_length=G) for P, S, C, G in shapes]


def oracle_rows(layouts, n, steps):
    """Row descriptors in generation order: ('doc', d, t), then ('gen', d, j, b, s) step-major."""
    rows = [("doc", d, t) for d, layout in enumerate(layouts) for t in range(layout.doc_length)]
    for s in range(steps):
        rows += [("gen", d, j, b, s) for d, layout in enumerate(layouts) for j in range(n)
                 for b in range(layout.num_blocks())]
    return rows


def oracle_attends(layouts, query, key):
    if query[1] != key[1]:
        return False
    if query[0] == "doc":
        return key[0] == "doc" and key[2] <= query[2]
    if key[0] == "doc":
        return key[2] < layouts[query[1]].anchors[query[3]]
    return key[2:4] == query[2:4] and key[4] <= query[4]


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("steps", [0, 1, 3])
def test_the_generation_order_mask_and_rows_are_the_rule_applied_to_every_descriptor(n, steps):
    layouts = layouts_of(DOC_SHAPES)
    order = generation_order(layouts, n, steps)
    rows = oracle_rows(layouts, n, steps)
    expected = torch.tensor([[oracle_attends(layouts, q, k) for k in rows] for q in rows], dtype=torch.bool)
    mask = dense_mask(order.meta)[0, 0]
    assert torch.equal(mask, expected)
    row_of = {descriptor: i for i, descriptor in enumerate(rows)}
    for d, layout in enumerate(layouts):
        assert order.doc_rows[d].tolist() == [row_of["doc", d, t] for t in range(layout.doc_length)]
        NB = layout.num_blocks()
        assert order.gen_rows[d].shape == order.predictor_rows[d].shape == (n, NB, steps)
        for j in range(n):
            for b, anchor in enumerate(layout.anchors):
                for s in range(steps):
                    row = order.gen_rows[d][j, b, s].item()
                    assert rows[row] == ("gen", d, j, b, s) and order.meta.pos[row] == anchor + s
                    predictor = ("doc", d, anchor - 1) if s == 0 else ("gen", d, j, b, s - 1)
                    assert order.predictor_rows[d][j, b, s] == row_of[predictor]
                    # never another block's or another sample's generated rows
                    others = [i for i, key in enumerate(rows) if key[0] == "gen" and key[1:4] != (d, j, b)]
                    assert not mask[row, others].any()


# ---- generation through the tiny model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def policy():
    from driver.config import Config
    from driver.policy.model import load_policy

    return load_policy(Config.model_validate({"lora": {"r": 4}}))


@pytest.fixture(scope="module")
def causal_lm(policy):
    return policy.causal_lm.eval()


def documents_for(layouts, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 300, (layout.doc_length,), generator=generator).tolist() for layout in layouts]


def sample(model, n, seed=0, shapes=DOC_SHAPES, **options):
    layouts = layouts_of(shapes)
    options = dict(temperature=1.0) | options
    return layouts, sample_strided(model, documents_for(layouts), layouts, n,
                                   generator=torch.Generator().manual_seed(seed), **options)


@torch.no_grad()
def block_logprobs(model, document, anchor, block_tokens, temperature):
    """Plain causal forward of x[:a_b] + the block's tokens: logprobs [G] of those tokens at temperature."""
    row = torch.tensor(document[:anchor] + block_tokens.tolist())
    logits = model(input_ids=row[None]).logits[0, anchor - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, block_tokens[:, None])[:, 0]


@torch.no_grad()
def greedy_continuation(model, prefix, length):
    row = list(prefix)
    for _ in range(length):
        row.append(model(input_ids=torch.tensor([row])).logits[0, -1].argmax().item())
    return row[len(prefix):]


@pytest.mark.parametrize("n", [1, 3])
def test_the_kv_cache_draws_the_tokens_the_full_recompute_draws(causal_lm, n):
    _, cached = sample(causal_lm, n, top_p=0.9)
    _, recomputed = sample(causal_lm, n, top_p=0.9, kv_cache=False)
    assert torch.equal(cached.input_ids, recomputed.input_ids)
    for d in range(len(DOC_SHAPES)):
        assert torch.equal(cached.tokens[d], recomputed.tokens[d])
        torch.testing.assert_close(cached.sampling_logprobs[d], recomputed.sampling_logprobs[d], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(temperature=1e-4), dict(temperature=1.0, top_k=1)])
def test_greedy_generation_is_each_blocks_plain_greedy_continuation(causal_lm, options):
    layouts, rollout = sample(causal_lm, 3, **options)
    documents = documents_for(layouts)
    for d, layout in enumerate(layouts):
        for b, anchor in enumerate(layout.anchors):
            expected = greedy_continuation(causal_lm, documents[d][:anchor], layout.generate_length)
            for j in range(3):
                assert rollout.tokens[d][j, b].tolist() == expected


@pytest.mark.parametrize("n", [1, 3])
def test_sampling_logprobs_and_the_full_row_forward_match_each_blocks_causal_forward(causal_lm, n):
    temperature = 0.7
    layouts, rollout = sample(causal_lm, n, temperature=temperature, top_p=0.95)
    documents = documents_for(layouts)
    input_ids, position_ids, mask = row_inputs(rollout, "cpu")
    with torch.no_grad():
        logits = causal_lm(input_ids=input_ids, position_ids=position_ids, attention_mask=mask).logits[0]
    for d, layout in enumerate(layouts):
        assert rollout.input_ids[rollout.doc_rows[d]].tolist() == documents[d]
        assert torch.equal(rollout.input_ids[rollout.gen_rows[d]], rollout.tokens[d])
        from_row = torch.log_softmax(logits[rollout.predictor_rows[d]] / temperature, -1)
        from_row = from_row.gather(-1, rollout.tokens[d][..., None])[..., 0]
        torch.testing.assert_close(from_row, rollout.sampling_logprobs[d], atol=1e-4, rtol=1e-4)
        for j in range(n):
            for b, anchor in enumerate(layout.anchors):
                alone = block_logprobs(causal_lm, documents[d], anchor, rollout.tokens[d][j, b], temperature)
                torch.testing.assert_close(rollout.sampling_logprobs[d][j, b], alone, atol=1e-4, rtol=1e-4)


def test_eager_attention_with_the_additive_mask_draws_the_tokens_sdpa_draws(causal_lm):
    _, sdpa = sample(causal_lm, 3)
    causal_lm.set_attn_implementation("eager")
    try:
        _, eager = sample(causal_lm, 3, additive_mask_dtype=torch.float32)
    finally:
        causal_lm.set_attn_implementation("sdpa")
    assert torch.equal(eager.input_ids, sdpa.input_ids)
    additive = row_inputs(sdpa, "cpu", torch.float32)[2]
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, row_inputs(sdpa, "cpu")[2])


def test_the_peft_wrapper_samples_like_its_base_and_the_training_mode_is_restored(policy, causal_lm):
    policy.model.train()
    try:
        _, wrapped = sample(policy.model, 3)  # LoRA B starts at zero: the same function as the base
        assert policy.model.training and causal_lm.training
    finally:
        policy.model.eval()
    _, base = sample(causal_lm, 3)
    assert torch.equal(wrapped.input_ids, base.input_ids)


def test_documents_without_blocks_are_their_rows_alone_and_longer_documents_are_cut(causal_lm):
    layouts = layouts_of([(6, 2, 5, 3), (4, 1, 4, 3)])
    documents = documents_for(layouts)
    rollout = sample_strided(causal_lm, [document + [7, 8] for document in documents], layouts, 2, temperature=1.0)
    assert torch.equal(rollout.input_ids, torch.tensor(sum(documents, [])))
    assert [tuple(tokens.shape) for tokens in rollout.tokens] == [(2, 0, 3), (2, 0, 3)]


def bad_inputs():
    """(documents, layouts, num_samples, the words the error must say)."""
    layouts = layouts_of(DOC_SHAPES)
    documents = documents_for(layouts)
    return [
        (documents[:2], layouts, 2, "pair up"),
        (documents, layouts, 0, "num_samples"),
        (documents + [list(range(10, 19))], layouts + layouts_of([(9, 2, 3, 4)]), 2, "generate_length"),
        ([documents[0][:-1]] + documents[1:], layouts, 2, r"documents\[0\] has 16 tokens, shorter .* 17"),
    ]


@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_bad_input_is_rejected_with_a_message_naming_the_problem(causal_lm, case):
    documents, layouts, n, message = bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        sample_strided(causal_lm, documents, layouts, n, temperature=1.0)
