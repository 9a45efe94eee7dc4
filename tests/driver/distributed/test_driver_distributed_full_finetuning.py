"""Full fine-tuning (model.adapter: none) under torchrun on CPU (gloo, FSDP2): 2 processes train every weight as
1 process does on the same global batch, with the KL reference (a copy, sharded too, which moves toward the
policy: algo.sync_ref_model), the server serving the weights gathered from the shards, the best evaluation's
model saved through the same gather, and a checkpoint resuming exactly (the fp32 shards and AdamW's state from
torch.distributed.checkpoint), in two processes or in one. The weights' own path is tested against one process in
tests/driver/distributed/test_driver_fsdp_full_model.py (bf16 master weights, tied and untied lm_head), and with
vLLM colocated on rank 0 in tests/driver/distributed/test_driver_distributed_rank0_work.py.

The server is the module's own: every sync of a full fine-tuning run reloads its weights (each run pushes its
start weights before it generates), which the session's shared server must not see.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from driver.data.tiny_model import resolve_model_path
from tests.conftest import launch_tiny_vllm_server
from tests.torchrun_runs import assert_same_weights, metrics, model, train, trained_steps

# The KL reference moves (algo.sync_ref_model, TR-DPO) after every update: a second sharded model to mix into,
# checkpoint and resume.
FULL = ["--model.adapter=none", "--train.lr=1e-4", "--algo.beta=0.04", "--algo.sync_ref_model=true",
        "--algo.ref_model_sync_steps=1", "--algo.ref_model_mixup_alpha=0.5"]


@pytest.fixture(scope="module")
def own_vllm_server(tmp_path_factory):
    server = launch_tiny_vllm_server(tmp_path_factory.mktemp("full-finetuning-server"))
    yield server.url
    server.stop()


@pytest.mark.slow
def test_two_processes_fine_tune_every_weight_as_one_process_and_resume(tmp_path, own_vllm_server):
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    # Evaluated after every step on 8 held-out prompts (both runs: the same prompts train), the best model kept:
    # rank 0 evaluates, every rank joins its save (the gather).
    evaluated = ["--eval.val_set_size=8", "--eval.steps=1", "--eval.save_best=true"]
    train(one, own_vllm_server, *FULL, *evaluated)
    train(two, own_vllm_server, *FULL, *evaluated, "--checkpoint.every=1", processes=2)
    rows_one, rows_two = trained_steps(one), trained_steps(two)
    assert len(rows_one) == len(rows_two) == 3
    for a, b in zip(rows_one, rows_two):
        assert a["reward"] == b["reward"]  # rank 0 generated and scored exactly what one process did
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-3, abs=1e-7)  # against the sharded reference
        assert b["sync/probe_max_abs_diff"] < 1e-3  # the server serves the weights gathered from the shards
    assert rows_two[-1]["kl"] > 0  # the policy moved away from its reference
    # Summation order differs (sharded reduce-scatter); a missed or doubled step moves weights by ~lr.
    assert_same_weights(model(one), model(two), atol=2e-5)
    base = load_file(Path(resolve_model_path("tiny://qwen2")) / "model.safetensors")
    assert base.keys() == model(two).keys()
    assert all(not torch.equal(model(two)[key], base[key]) for key in base)  # every weight trained (lm_head too)
    assert sorted(p.name for p in (two / "checkpoints" / "step-000002" / "optimizer").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    best = json.loads((two / "best" / "best.json").read_text())
    assert best["eval/reward"] == max(row["eval/reward"] for row in metrics(two) if "eval/version" in row)
    kept = two / "checkpoints" / f"step-{best['step']:06d}"  # (the two newest are kept)
    if kept.is_dir():
        assert_same_weights(load_file(two / "best" / "model.safetensors"), model(kept), atol=0)  # what ranks held then

    checkpoint = f"--checkpoint.resume={two / 'checkpoints' / 'step-000002'}"
    train(resumed, own_vllm_server, *FULL, *evaluated, checkpoint, processes=2)
    rows_resumed = trained_steps(resumed)
    assert [row["step"] for row in rows_resumed] == [3]
    assert rows_resumed[0]["reward"] == rows_two[2]["reward"]
    assert rows_resumed[0]["kl"] == pytest.approx(rows_two[2]["kl"], rel=1e-5)  # the moved reference resumed
    assert_same_weights(model(resumed), model(two), atol=1e-6)

    alone = tmp_path / "alone"  # the sharded checkpoint resumed in one process (the shards loaded whole)
    train(alone, own_vllm_server, *FULL, *evaluated, checkpoint)
    rows_alone = trained_steps(alone)
    assert [row["step"] for row in rows_alone] == [3] and rows_alone[0]["reward"] == rows_two[2]["reward"]
    assert rows_alone[0]["kl"] == pytest.approx(rows_two[2]["kl"], rel=1e-3)
    assert_same_weights(model(alone), model(two), atol=2e-5)  # as one process against two, above

