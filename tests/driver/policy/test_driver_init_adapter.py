"""lora.init_from: a run starts from a trained adapter (an SFT run's). Its settings become the lora section's
(a value the config gives must agree), its weights load into our fused-kernel adapter, and the policy then
computes what PEFT's own PeftModel.from_pretrained computes with that adapter (the oracle). Adapters this
driver cannot train on, and weights that do not fit, are named by key; a Hub id resolves from the cache."""

import json
import shutil

import pytest
import torch
import yaml
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.data.adapter_settings import adopt_adapter_settings
from driver.data.model_source import adapter_directory
from driver.data.tiny_model import resolve_model_path
from driver.policy.model import load_policy
from tests.hub_cache import cache_with

SFT = {"r": 4, "alpha": 12.0, "targets": ["q_proj", "v_proj"], "dropout": 0.1}  # unlike the defaults (8, 16, ...)
TOKENS = [[3, 17, 42, 99, 7, 250, 31, 5]]


@pytest.fixture(scope="module")
def sft_adapter(tmp_path_factory):
    """An adapter as an SFT run leaves it: trained (random, non-zero A and B), saved in PEFT's format."""
    policy = load_policy(Config.model_validate({"lora": SFT}))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if ".lora_" in name:
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    directory = tmp_path_factory.mktemp("sft") / "adapter"
    policy.save_trained(directory)
    return directory


@pytest.fixture(autouse=True)
def fresh_resolution():
    adapter_directory.cache_clear()
    yield
    adapter_directory.cache_clear()


def config_file(tmp_path, lora: dict, **sections) -> Config:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"lora": lora, **sections}))
    return load_config(path, {})


@torch.no_grad()
def peft_logits(adapter) -> torch.Tensor:
    """PEFT's own loading of the adapter onto the base, in eager transformers: the oracle."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=torch.tensor(TOKENS)).logits


@torch.no_grad()
def peft_logits_without_adapter() -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"), dtype=torch.float32)
    return base.eval()(input_ids=torch.tensor(TOKENS)).logits


def test_the_policy_starts_as_the_adapter_with_its_settings(sft_adapter, tmp_path):
    config = config_file(tmp_path, {"init_from": str(sft_adapter)})
    adopt_adapter_settings(config)
    assert (config.lora.r, config.lora.alpha, sorted(config.lora.targets)) == (4, 12.0, ["q_proj", "v_proj"])
    assert config.lora.dropout == 0.1  # PeftModel.from_pretrained trains with the saved dropout too
    policy = load_policy(config)
    with torch.no_grad():
        logits = policy.causal_lm.eval()(input_ids=torch.tensor(TOKENS)).logits
    expected = peft_logits(sft_adapter)
    assert (expected - peft_logits_without_adapter()).abs().max() > 1e-2  # the adapter changes the function
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    trainable = [name for name, parameter in policy.model.named_parameters() if parameter.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    # The run's own config.yaml (written after adoption, every key in it) reads back, each key agreeing.
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    again = load_config(tmp_path / "config.yaml", {})
    adopt_adapter_settings(again)
    assert again.lora == config.lora


def test_a_value_the_config_gives_must_agree(sft_adapter, tmp_path):
    agreeing = config_file(tmp_path, {"init_from": str(sft_adapter), "r": 4, "targets": ["v_proj", "q_proj"]})
    adopt_adapter_settings(agreeing)
    assert agreeing.lora.alpha == 12.0
    without_dropout = config_file(tmp_path, {"init_from": str(sft_adapter), "dropout": 0.0})
    adopt_adapter_settings(without_dropout)  # a training knob: the one given wins, as PEFT's config= would
    assert without_dropout.lora.dropout == 0.0
    with pytest.raises(ConfigError, match=r"lora.r = 8, but the adapter lora.init_from \(.*adapter\) has 4: leave "
                                          r"lora.r out \(the adapter's is taken\) or give its value"):
        adopt_adapter_settings(config_file(tmp_path, {"init_from": str(sft_adapter), "r": 8}))
    with pytest.raises(ConfigError, match=r"lora.targets = \['q_proj'\], but .* has \['q_proj', 'v_proj'\]"):
        adopt_adapter_settings(config_file(tmp_path, {"init_from": str(sft_adapter), "targets": ["q_proj"]}))


def edited_adapter(sft_adapter, tmp_path, config_changes=None, weights=None):
    directory = tmp_path / "edited"
    shutil.copytree(sft_adapter, directory)
    if config_changes:
        saved = json.loads((directory / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps({**saved, **config_changes}))
    if weights is not None:
        save_file(weights(load_file(directory / "adapter_model.safetensors")), directory / "adapter_model.safetensors")
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "uses DoRA, which this driver's LoRA layers do not train"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
    ({"target_modules": "all-linear"}, "targets modules by the pattern 'all-linear'; lora.targets takes module names"),
    ({"peft_type": "IA3"}, "is a IA3 adapter; training continues LoRA adapters only"),
])
def test_adapters_this_driver_cannot_train_on_are_named(sft_adapter, tmp_path, changes, message):
    directory = edited_adapter(sft_adapter, tmp_path, changes)
    with pytest.raises(ConfigError, match=f"lora.init_from: {directory}.* {message}".replace("(", r"\(")
                       .replace(")", r"\)")):
        adopt_adapter_settings(config_file(tmp_path, {"init_from": str(directory)}))


def test_weights_that_do_not_fit_are_named(sft_adapter, tmp_path):
    def drop_one(state):
        return {key: value for index, (key, value) in enumerate(sorted(state.items())) if index}

    def add_one(state):
        return {**state, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 64)}

    for name, edit, message in (("missing", drop_one, "without weights: ['base_model"),
                                ("extra", add_one, "weights it has that the model lacks: ['base_model")):
        directory = edited_adapter(sft_adapter, tmp_path / name, weights=edit)
        config = config_file(tmp_path, {"init_from": str(directory)})
        adopt_adapter_settings(config)
        with pytest.raises(ConfigError, match=r"lora.init_from: .* does not match this model's LoRA layers .*"
                                              + message.replace("[", r"\[")):
            load_policy(config)
    not_an_adapter = tmp_path / "empty"
    not_an_adapter.mkdir()
    with pytest.raises(ConfigError, match=r"is not a PEFT adapter \(no adapter_config.json or "
                                          r"adapter_model.safetensors\)"):
        adopt_adapter_settings(config_file(tmp_path, {"init_from": str(not_an_adapter)}))


def test_a_hub_id_resolves_from_the_cache_offline(sft_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snapshot = cache_with(tmp_path / "hub", "acme/sft-lora", {"main": "c" * 40}, model=str(sft_adapter))["c" * 40]
    config = config_file(tmp_path, {"init_from": "acme/sft-lora"})
    adopt_adapter_settings(config)
    assert adapter_directory("acme/sft-lora") == str(snapshot) and config.lora.r == 4
    with pytest.raises(ConfigError, match=r"lora.init_from: acme/other is not in the Hugging Face cache .* local "
                                          r"adapter directory"):
        adopt_adapter_settings(config_file(tmp_path, {"init_from": "acme/other"}))


def test_full_finetuning_has_no_adapter_to_start_from(tmp_path):
    with pytest.raises(ConfigError, match="model.adapter = none .* cannot go with lora.init_from"):
        config_file(tmp_path, {"init_from": "acme/sft-lora"}, model={"adapter": "none"})
