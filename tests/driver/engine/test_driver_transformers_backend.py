"""rollout.backend: transformers against oracles that share nothing with generate's batching: each
sampled completion rescored alone (one unpadded forward, no cache), its logits put through the
sampling transforms written out by hand (repetition penalty, temperature, top-k, top-p), log_softmax,
the sampled token read off: the recorded sampling logprobs must match, so importance weights are exact.
Also: end of sequence and max_tokens as vLLM reports them, stop strings, seeds, the config's limits."""

import pytest
import torch

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.engine.base import Request
from driver.engine.transformers_backend import TransformersGenerator
from driver.policy.model import load_policy

PROMPTS = [[10, 20, 30], [40, 50, 60, 70, 80, 90], [7]]


@pytest.fixture(scope="module")
def policy():
    return load_policy(Config.model_validate({"lora": {"r": 4}}))


def generator(policy, **sampling):
    config = Config.model_validate({"lora": {"r": 4}, "rollout": {"backend": "transformers",
                                                                  "sampling": {"max_tokens": 12, **sampling}}})
    return TransformersGenerator(config, policy)


def processed_logprobs(logits, history, temperature, top_k, top_p, penalty):
    """One step's sampled-from distribution, by hand: HF's repetition penalty over prompt + completion so
    far, then temperature, top-k, top-p (keeping the smallest set whose mass reaches top_p)."""
    scores = logits.clone()
    seen = torch.tensor(sorted(set(history)))
    picked = scores[seen]
    scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    scores = scores / temperature
    if top_k > 0:
        scores[scores < scores.topk(top_k).values[-1]] = -torch.inf
    if top_p < 1:
        ordered, order = scores.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= top_p  # mass before this token already reaches top_p
        scores[order[drop]] = -torch.inf
    return scores.log_softmax(-1)


@torch.no_grad()
def test_recorded_logprobs_are_those_of_the_sampled_distribution(policy):
    knobs = dict(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3)
    backend = generator(policy, **knobs)
    requests = [Request(prompt, 3, 100 + 3 * i, 12) for i, prompt in enumerate(PROMPTS)]
    results = dict(backend.stream(requests, version=0))
    model = policy.causal_lm
    model.eval()
    checked = 0
    for index, prompt in enumerate(PROMPTS):
        for completion in results[index]:
            sequence = torch.tensor([prompt + completion.token_ids])
            logits = model(input_ids=sequence).logits[0].float()
            for t, token in enumerate(completion.token_ids):
                expected = processed_logprobs(logits[len(prompt) - 1 + t], prompt + completion.token_ids[:t],
                                              knobs["temperature"], knobs["top_k"], knobs["top_p"],
                                              knobs["repetition_penalty"])[token]
                assert completion.logprobs[t] == pytest.approx(float(expected), abs=2e-4)
                checked += 1
    assert checked > 30


def test_completions_end_as_vllms_and_seeds_reproduce(policy):
    backend = generator(policy)
    eos = policy.tokenizer.eos_token_id
    first = backend.generate(PROMPTS, n=4, seed=5)
    assert first == backend.generate(PROMPTS, n=4, seed=5)
    assert first != backend.generate(PROMPTS, n=4, seed=6)
    for samples in first:
        for completion in samples:
            assert len(completion.token_ids) == len(completion.logprobs) <= 12
            if completion.finish_reason == "length":
                assert len(completion.token_ids) == 12 and eos not in completion.token_ids
            else:  # ended by the model: its end-of-sequence token kept, nothing after it
                assert completion.token_ids[-1] == eos and eos not in completion.token_ids[:-1]


@torch.no_grad()
def test_temperature_zero_decodes_greedily_as_transformers_does(policy):
    """An evaluation's greedy request against transformers' own greedy search (do_sample=False), one prompt at
    a time; requests at the section's temperature in the same call still sample."""
    backend = generator(policy, temperature=0.7)
    greedy = [Request(prompt, 1, 5, 12, temperature=0.0) for prompt in PROMPTS]
    results = dict(backend.stream(greedy + [Request(PROMPTS[0], 4, 9, 12)], version=0))
    model = policy.causal_lm.eval()
    for index, prompt in enumerate(PROMPTS):
        expected = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                  eos_token_id=sorted(backend.eos_ids), pad_token_id=backend.pad_id)[0, len(prompt):]
        ended = next((i + 1 for i, token in enumerate(expected.tolist()) if token in backend.eos_ids), len(expected))
        assert results[index][0].token_ids == expected.tolist()[:ended]
    assert len({tuple(c.token_ids) for c in results[len(PROMPTS)]}) > 1


def test_stop_strings_end_the_completion_after_the_token_that_completes_them(policy):
    backend = generator(policy, stop=[" "], max_tokens=16)
    tokenizer = policy.tokenizer
    stopped = 0
    for samples in backend.generate(PROMPTS, n=6, seed=1):
        for completion in samples:
            text = tokenizer.decode(completion.token_ids)
            assert completion.finish_reason == "stop" or len(completion.token_ids) == 16
            if " " in text:  # ended by the stop string: the token that completed it is the last
                assert " " not in tokenizer.decode(completion.token_ids[:-1])
                assert tokenizer.eos_token_id not in completion.token_ids  # no padding taken for an end
                stopped += 1
    assert stopped > 0


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.async_prefetch": "true"}, "rollout.async_prefetch: not supported by rollout.backend = transformers"),
    ({"rollout.sampling.structured_outputs": "{regex: '[0-9]+'}"}, "rollout.sampling.structured_outputs: not"),
    ({"rollout.sampling.generation_kwargs": "{top_k: 5}"}, "top_k must be set in rollout.sampling itself"),
])
def test_what_the_transformers_backend_cannot_do_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"rollout.backend": "transformers", **overrides})
