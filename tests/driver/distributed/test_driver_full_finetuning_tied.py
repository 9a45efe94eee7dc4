"""Full fine-tuning of a model whose lm_head is its input embeddings (tie_word_embeddings: Qwen2.5 up to 3B, Llama
3.2, Gemma), the tiny Qwen2 tied: vLLM on CPU computes the logits from a packed copy of the head's weight made
after loading, which a weight reload left stale (the head receives no weight of its own), and every run failed
its first sync probe (driver/engine/weight_sync.py refresh_shared_weights). Colocated in one process (the
in-process reload) and under torchrun with a launched server (the worker extension's reload), where the tied
weight is one FSDP parameter of the root unit, gathered, saved without its second name, and resumed. The server is
the module's own (a full fine-tuning run reloads its weights), launched once for both torchrun runs: the resumed
run pushes its checkpoint's weights before it generates.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from driver.data.tiny_model import resolve_model_path
from tests.conftest import launch_tiny_vllm_server
from tests.torchrun_runs import assert_same_weights, metrics, model, train

TRAINED = ["--model.adapter=none", "--train.lr=1e-3", "--train.steps=2"]


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """tiny://qwen2 with its lm_head tied to the embeddings (the embeddings' weights serve both, as
    save_pretrained writes a tied model)."""
    directory = tmp_path_factory.mktemp("tied") / "model"
    shutil.copytree(resolve_model_path("tiny://qwen2"), directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}, indent=2))
    weights = load_file(directory / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def tied_server(tmp_path_factory, tied_model) -> str:
    server = launch_tiny_vllm_server(tmp_path_factory.mktemp("tied-server"), str(tied_model))
    yield server.url
    server.stop()


def assert_synced(output_dir: Path, steps: int) -> list[dict]:
    rows = metrics(output_dir)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(row["sync/probe_max_abs_diff"] < 1e-3 for row in rows)  # measured before the fix: 0.024
    return rows


@pytest.mark.slow
def test_a_tied_model_syncs_into_the_colocated_engine(tmp_path, tied_model):
    train(tmp_path, None, *TRAINED, f"--model.path={tied_model}", "--rollout.backend=colocate")
    assert_synced(tmp_path, 2)
    saved = model(tmp_path)
    assert "lm_head.weight" not in saved  # tied: saved once, as the embeddings
    assert not torch.equal(saved["model.embed_tokens.weight"], load_file(tied_model / "model.safetensors")[
        "model.embed_tokens.weight"])


@pytest.mark.slow
def test_two_processes_fine_tune_a_tied_model_through_a_server_and_resume(tmp_path, tied_model, tied_server):
    two, resumed = tmp_path / "two", tmp_path / "resumed"
    flags = [*TRAINED, f"--model.path={tied_model}", "--checkpoint.every=1"]
    train(two, tied_server, *flags, processes=2)
    rows = assert_synced(two, 2)
    train(resumed, tied_server, *flags, f"--checkpoint.resume={two / 'checkpoints' / 'step-000001'}", processes=2)
    assert metrics(resumed)[0]["reward"] == rows[1]["reward"]
    final, again = (model(run) for run in (two, resumed))
    assert final.keys() == again.keys() == {name for name in load_file(tied_model / "model.safetensors")}
    assert_same_weights(again, final, atol=1e-6)
