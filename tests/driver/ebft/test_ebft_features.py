"""driver.ebft.features against hand-written loops and transformers' own hidden states."""

import math

import pytest
import torch

from driver.ebft.features import hidden_layer_states, layer_indices, pool, token_features

# (num_layers, fractions, indices into output_hidden_states)
LAYER_TABLE = [
    (2, [0.25, 0.5, 0.75], [1, 1, 1]),  # the tiny model: axolotl's int(f * L) would give [0, 1, 1]
    (2, [0.5, 1.0], [1, 2]),
    (24, [0.25, 0.5, 0.75], [6, 12, 18]),
    (7, [0.1, 0.5, 1.0], [1, 3, 7]),
    (1, [0.3], [1]),
]
BAD_FRACTIONS = [[], [0.0], [1.5], [0.5, -0.25]]
FEATURES_SHAPE = (23, 7)  # [L, F]
# (sequence_start, completion_start, end): ordinary, long prompt and one-token completion, prompt-less
SPANS = [(0, 4, 11), (11, 19, 20), (20, 20, 23)]


def hand_normalized(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector]


def test_fractions_map_to_layers_as_the_official_code_clamped_away_from_the_embeddings():
    for num_layers, fractions, expected in LAYER_TABLE:
        assert layer_indices(num_layers, fractions) == expected, (num_layers, fractions)


@pytest.mark.parametrize("fractions", BAD_FRACTIONS)
def test_fractions_outside_zero_one_or_none_are_rejected(fractions):
    with pytest.raises(ValueError, match="fractions"):
        layer_indices(4, fractions)


def test_token_features_normalize_each_layer_then_concatenate_to_a_unit_vector():
    generator = torch.Generator().manual_seed(0)
    # non-contiguous layer states, different scales per layer
    states = [torch.randn(5, 11, generator=generator, dtype=torch.float64).T * scale for scale in (0.1, 1.0, 30.0)]
    features = token_features(states)
    expected = [[x / math.sqrt(len(states)) for state in states for x in hand_normalized(state[t].tolist())]
                for t in range(11)]
    torch.testing.assert_close(features, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(features.norm(dim=-1), torch.ones(11, dtype=torch.float64))
    for layer in range(len(states)):
        layer_slice = features[:, layer * 5:(layer + 1) * 5]
        torch.testing.assert_close(layer_slice.norm(dim=-1), torch.full((11,), 1 / math.sqrt(3), dtype=torch.float64))


def random_features() -> torch.Tensor:
    return torch.randn(*FEATURES_SHAPE, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def hand_pool(features: torch.Tensor, span: tuple[int, int, int], method: str) -> list[float]:
    rows = features.tolist()
    sequence_start, completion_start, end = span

    def mean(first: int, last: int) -> list[float]:
        return [sum(rows[t][f] for t in range(first, last)) / (last - first) for f in range(len(rows[0]))]

    if method == "last_token":
        return rows[end - 1]
    if method == "mean_pooling":
        return mean(sequence_start, end)
    if method == "completion_mean":
        return mean(completion_start, end)
    length = end - completion_start
    quartiles = [completion_start + length // 4, completion_start + length // 2, completion_start + 3 * length // 4]
    return [x / math.sqrt(3) for position in quartiles for x in rows[position]]


def axolotl_concat(hidden_states: torch.Tensor, valid_lens: torch.Tensor) -> torch.Tensor:
    """axolotl rewards.apply_embed_method(method="concat"), transcribed: [B, S, D] -> [B, 3D]."""
    batch, length, _ = hidden_states.shape
    q1 = (valid_lens // 4).clamp(min=0, max=length - 1)
    q2 = (valid_lens // 2).clamp(min=0, max=length - 1)
    q3 = (3 * valid_lens // 4).clamp(min=0, max=length - 1)
    index = torch.arange(batch)
    return torch.cat([hidden_states[index, q1], hidden_states[index, q2], hidden_states[index, q3]], dim=-1)


@pytest.mark.parametrize("method", ["last_token", "mean_pooling", "completion_mean", "concat"])
def test_each_pool_method_reads_the_positions_written_out_by_hand(method):
    features = random_features()
    expected = torch.tensor([hand_pool(features, span, method) for span in SPANS], dtype=torch.float64)
    torch.testing.assert_close(pool(features, SPANS, method), expected, atol=1e-12, rtol=1e-12)


def test_concat_reads_the_completion_quartiles_not_the_whole_sequence():
    features = random_features()
    pooled = pool(features, [(0, 16, 20)], "concat")  # completion of 4 tokens: positions 17, 18, 19
    torch.testing.assert_close(pooled[0], torch.cat([features[17], features[18], features[19]]) / math.sqrt(3))


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 83])
def test_concat_reads_axolotls_quartile_positions_of_the_completion_alone_scaled_to_unit_tokens(length):
    # axolotl's formula on the completion alone (its valid length is prompt + completion; ours is not).
    completion = torch.nn.functional.normalize(
        torch.randn(1, length, 5, generator=torch.Generator().manual_seed(length), dtype=torch.float64), dim=-1)
    prompt = torch.zeros(1, 6, 5, dtype=torch.float64)
    row = torch.cat([prompt, completion], dim=1)[0]
    pooled = pool(row, [(0, 6, 6 + length)], "concat")[0]
    torch.testing.assert_close(pooled, axolotl_concat(completion, torch.tensor([length]))[0] / math.sqrt(3))
    torch.testing.assert_close(pooled.norm(), torch.tensor(1.0, dtype=torch.float64))  # unit tokens -> unit vector


@pytest.mark.parametrize("method", ["last_token", "completion_mean", "concat"])
def test_an_empty_completion_falls_back_to_the_last_prompt_token(method):
    features = random_features()
    pooled = pool(features, [(2, 9, 9)], method)
    copies = 3 if method == "concat" else 1
    torch.testing.assert_close(pooled[0], torch.cat([features[8]] * copies) / math.sqrt(copies))


def test_an_empty_completion_still_mean_pools_its_prompt():
    features = random_features()
    torch.testing.assert_close(pool(features, [(2, 9, 9)], "mean_pooling")[0], features[2:9].mean(dim=0))


def test_an_unknown_method_is_rejected_listing_the_choices():
    with pytest.raises(ValueError, match="last_token.*mean_pooling.*completion_mean.*concat"):
        pool(random_features(), SPANS, "max_pooling")


@pytest.mark.parametrize("span", [(3, 2, 9), (0, 4, 24), (5, 5, 5)])
def test_spans_outside_the_row_or_out_of_order_are_rejected(span):
    with pytest.raises(ValueError, match="span"):
        pool(random_features(), [span], "last_token")


@pytest.fixture(scope="module")
def policy():
    from driver.config import Config
    from driver.policy.model import load_policy

    policy = load_policy(Config.model_validate({"lora": {"r": 4}}))
    policy.model.eval()
    with torch.no_grad():  # LoRA B starts at 0: make the adapter change the hidden states
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return policy


@pytest.mark.parametrize("explicit_positions", [False, True])
def test_layer_states_are_the_base_models_hidden_states_with_the_adapter_disabled(policy, explicit_positions):
    input_ids = torch.randint(3, 100, (1, 13), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(13).unsqueeze(0) if explicit_positions else None
    num_layers = policy.causal_lm.config.num_hidden_layers
    layers = layer_indices(num_layers, [0.5, 1.0])
    with policy.reference(), torch.no_grad():
        states = hidden_layer_states(policy.model, input_ids, position_ids, None, layers)
        unwrapped = hidden_layer_states(policy.causal_lm, input_ids, position_ids, None, layers)
        expected = policy.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        adapted = policy.model(input_ids=input_ids, output_hidden_states=True).hidden_states
    assert len(states) == len(layers)
    for state, again, layer in zip(states, unwrapped, layers):
        torch.testing.assert_close(state, expected[layer][0], atol=0, rtol=0)
        torch.testing.assert_close(again, state, atol=0, rtol=0)
        assert not torch.allclose(state, adapted[layer][0])  # the adapter really was off
    assert not states[0].requires_grad
