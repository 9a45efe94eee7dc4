"""Packed scoring (pykernels.integrations.transformers.packed_hidden_states + token_logprobs) equals
scoring a right-padded batch with transformers' own forward, on tiny random Qwen2 and Llama."""

import pytest
import torch

from driver.data.tiny_model import resolve_model_path
from pykernels.integrations.transformers import packed_hidden_states, packed_position_ids
from pykernels.logprobs import IGNORE_INDEX, packed_targets, token_logprobs

SEQUENCES = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19], [20, 21, 22]]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(f"tiny://{request.param}"), dtype=torch.float32)


def padded_logprobs(model, temperature):
    """Per-sequence next-token logprobs from one right-padded batch with an attention mask."""
    width = max(map(len, SEQUENCES))
    ids = torch.zeros(len(SEQUENCES), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(SEQUENCES):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double() / temperature
    log_probs = torch.log_softmax(logits, -1)
    return [log_probs[row, :len(seq) - 1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            for row, seq in enumerate(SEQUENCES)]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_packed_equals_padded(model, attention, temperature):
    model.config._attn_implementation = attention
    ids = torch.tensor([t for seq in SEQUENCES for t in seq])
    cu_seqlens = torch.tensor([0] + [len(s) for s in SEQUENCES]).cumsum(0)
    targets = packed_targets(ids, cu_seqlens)
    with torch.no_grad():
        hidden = packed_hidden_states(model, ids, cu_seqlens)
        logprobs = token_logprobs(hidden, model.get_output_embeddings().weight, targets, temperature)
    for row, expected in enumerate(padded_logprobs(model, temperature)):
        start, end = int(cu_seqlens[row]), int(cu_seqlens[row + 1])
        torch.testing.assert_close(logprobs[start:end - 1].double(), expected, atol=2e-5, rtol=0)
        assert targets[end - 1] == IGNORE_INDEX and logprobs[end - 1] == 0


def test_position_ids_restart_per_sequence():
    assert packed_position_ids(torch.tensor([0, 3, 4, 6])).tolist() == [0, 1, 2, 0, 0, 1]


def test_bad_cu_seqlens(model):
    ids = torch.tensor([1, 2, 3, 4])
    for bad in ([0, 2, 5], [1, 4], [0, 3, 3, 4], [[0, 4]]):
        with pytest.raises(ValueError, match="cu_seqlens must"):
            packed_hidden_states(model, ids, torch.tensor(bad))
