"""model.path as TRL and axolotl users write it: a Hugging Face Hub id (driver/data/model_source.py), resolved by
the real huggingface_hub against a cache laid out as it writes one (tests/hub_cache.py), offline: no test
downloads. A local directory and tiny:// names resolve as before; mistakes name the key."""

import json
import warnings
from pathlib import Path

import pytest
from huggingface_hub import constants

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.config import is_hub_id
from driver.data.model_source import model_directory
from driver.data.tiny_model import resolve_model_path
from tests.hub_cache import cache_with

MAIN, TAGGED = "a" * 40, "b" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache holding acme/tiny-qwen2 at main and at tag v1."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model_directory.cache_clear()
    yield cache_with(tmp_path / "hub", "acme/tiny-qwen2", {"main": MAIN, "v1": TAGGED})
    model_directory.cache_clear()


def test_a_hub_id_resolves_to_its_cached_snapshot_at_the_revision_asked(hub):
    assert model_directory("acme/tiny-qwen2") == str(hub[MAIN])
    assert model_directory("acme/tiny-qwen2", "v1") == str(hub[TAGGED])  # a tag, through refs/
    assert model_directory("acme/tiny-qwen2", TAGGED) == str(hub[TAGGED])  # a commit


def test_an_uncached_model_offline_says_where_it_looked_and_what_to_do(hub):
    with pytest.raises(ConfigError, match=r"model.path: acme/other is not in the Hugging Face cache \(.*hub\) and "
                                          r"HF_HUB_OFFLINE is set: fetch it .*\(`hf download acme/other`\)"):
        model_directory("acme/other")
    with pytest.raises(ConfigError, match="acme/tiny-qwen2 at revision v9 is not in the Hugging Face cache"):
        model_directory("acme/tiny-qwen2", "v9")


def test_local_directories_and_tiny_models_are_not_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model")  # exists here: a relative local path
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id("meta-llama/Llama-3.2-1B")
    for path in ("tiny://qwen2", "/abs/model", "a/b/c", "model", "org/", "./org", "../org", "org/.x"):
        assert not is_hub_id(path), path
    assert model_directory("org/model") == "org/model"
    assert model_directory("tiny://qwen2") == resolve_model_path("tiny://qwen2")


def test_the_cli_takes_a_hub_id_and_its_revision(hub):
    config = load_config(None, {"model.path": "acme/tiny-qwen2", "model.revision": "v1"})
    assert (config.model.path, config.model.revision) == ("acme/tiny-qwen2", "v1")


def test_the_policy_loads_from_the_snapshot_and_its_adapter_names_the_hub_id(hub, tmp_path):
    from driver.policy.model import load_policy

    config = Config.model_validate({"model": {"path": "acme/tiny-qwen2", "revision": "v1"}})
    policy = load_policy(config)
    assert policy.model_dir == str(hub[TAGGED])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy.save_trained(tmp_path / "adapter")  # at every sync: PEFT must not ask the Hub about the base
    assert not [str(w.message) for w in caught if "acme/tiny-qwen2" in str(w.message)]
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # where PEFT and vLLM users find the base: the Hub id, not this machine's cache
    assert (saved["base_model_name_or_path"], saved["revision"]) == ("acme/tiny-qwen2", "v1")
    assert not Path(saved["base_model_name_or_path"]).exists()
