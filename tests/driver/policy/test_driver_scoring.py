"""Completions scored on packed sequences equal the same completions scored one by one."""

import pytest
import torch

from driver.data.tiny_model import resolve_model_path
from driver.policy.logprobs import completion_logprobs, pack
from pykernels.integrations.transformers import block_causal_mask
from pykernels.logprobs import IGNORE_INDEX, packed_targets

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
COMPLETIONS = [[20, 21], [22, 23, 24, 25, 26], [27], [28, 29, 30]]


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3-moe"])
def model(request):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(f"tiny://{request.param}"), dtype=torch.float32)


def one_by_one(model, temperature):
    rows = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].double() / temperature
        rows.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0])
    return rows


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_packed_equals_one_by_one(model, attention, temperature):
    model.config._attn_implementation = attention
    with torch.no_grad():
        logps, entropy, mask = completion_logprobs(model, pack(PROMPTS, COMPLETIONS), temperature, return_entropy=True)
    expected = one_by_one(model, temperature)
    for row, reference in enumerate(expected):
        n = len(COMPLETIONS[row])
        torch.testing.assert_close(logps[row, :n].double(), reference, atol=2e-5, rtol=0)
        assert mask[row, :n].all() and not mask[row, n:].any() and not logps[row, n:].any()
    assert (entropy[mask.bool()] > 0).all()


def test_gradients_flow_through_packed_scoring(model):
    model.zero_grad()
    logps, _, _ = completion_logprobs(model, pack(PROMPTS, COMPLETIONS))
    logps.sum().backward()
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0


def test_block_causal_mask_isolates_sequences():
    mask = block_causal_mask(torch.tensor([0, 2, 5]), torch.float32)[0, 0]
    allowed = mask == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]).bool()
    assert torch.equal(allowed, expected)


def test_packed_targets_never_cross_a_sequence_boundary():
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    targets = packed_targets(ids, torch.tensor([0, 3, 4, 6]))
    assert targets.tolist() == [2, 3, IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        pack([[1], [2]], [[3]])
    with pytest.raises(ValueError, match="at least one token"):
        pack([[]], [[3]])
