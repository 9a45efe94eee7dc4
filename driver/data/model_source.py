"""Where the policy's weights come from: `model.path` names a tiny random model built here (tiny://qwen2,
driver/data/tiny_model.py), a local model directory, or a model on the Hugging Face Hub by id (`org/name`,
at `model.revision`), as TRL's and axolotl's configs name it. A Hub model is fetched into the Hub's own
cache (HF_HOME / HF_HUB_CACHE, shared with transformers and vLLM) on first use and read from there after;
with HF_HUB_OFFLINE=1, or without a connection, the cached snapshot is used. Only what loading needs is
fetched: configs, tokenizer files and safetensors weights (PyTorch pickles only where a repository has no
safetensors), not the other formats repositories carry beside them (GGUF, ONNX, original/*.pth).
Everything downstream (transformers, PEFT, vLLM, the NF4 base) reads the one local directory.
`lora.init_from`, a trained adapter to start from, comes the same way: a local directory or a Hub id."""

from __future__ import annotations

import functools
from pathlib import Path

from driver.cli import ConfigError
from driver.config import is_hub_id
from driver.data.tiny_model import resolve_model_path

HUB_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@functools.cache  # one fetch per process: the policy, the engine and the NF4 base all ask
def model_directory(path: str, revision: str | None = None) -> str:
    """The local directory of model.path (see the top of this file)."""
    return hub_snapshot(path, revision) if is_hub_id(path) else resolve_model_path(path)  # tiny://, or as given


@functools.cache
def adapter_directory(path: str) -> str:
    """The local directory of lora.init_from: a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors), given as one or fetched from the Hub."""
    directory = hub_snapshot(path, None, ADAPTER_FILES, key="lora.init_from", what="adapter") \
        if is_hub_id(path) else path
    missing = [name for name in ADAPTER_FILES if not (Path(directory) / name).is_file()]
    if missing:
        raise ConfigError(f"lora.init_from: {path} is not a PEFT adapter (no {' or '.join(missing)}"
                          + (" in its Hub repository)" if is_hub_id(path) else ")"))
    return directory


def hub_snapshot(repo_id: str, revision: str | None, patterns: tuple[str, ...] = HUB_FILES, *,
                 key: str = "model.path", what: str = "model") -> str:
    """The repository's files matching `patterns`, fetched into the Hub's cache; every failure a ConfigError
    naming `key` (model.path, or lora.init_from for an adapter)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision}" if revision else ""
    try:
        directory = snapshot_download(repo_id, revision=revision, allow_patterns=list(patterns))
        if patterns == HUB_FILES and not any(Path(directory).glob("*.safetensors")):  # PyTorch pickles only
            directory = snapshot_download(repo_id, revision=revision, allow_patterns=[*HUB_FILES, "*.bin"])
    except GatedRepoError:
        raise ConfigError(f"{key}: {repo_id} is gated on the Hugging Face Hub: accept its terms on "
                          f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ConfigError(f"model.revision: {revision} is not a branch, tag or commit of {repo_id}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: {repo_id} is neither a local directory nor a {what} on the Hugging Face Hub "
                          "(a private one needs `hf auth login`, or HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise ConfigError(f"{key}: {repo_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                          f"and {why}: fetch it where the Hub is reachable (`hf download {repo_id}`), or give a "
                          f"local {what} directory") from None
    except (HfHubHTTPError, OSError) as error:
        raise ConfigError(f"{key}: fetching {repo_id}{at} from the Hugging Face Hub failed: {error}") from None
    return directory
