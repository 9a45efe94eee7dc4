"""Training under torchrun on CPU (gloo, FSDP2): 2 processes train the adapter 1 process trains on the
same global batch, checkpoints resume exactly, at the same or another world size (one process's under torchrun
too); and what a torchrun launch cannot do yet is refused up front
(tests/driver/distributed/test_driver_distributed_rank0_work.py: the work at assembly every rank shares, and the
colocated engine).

The end-to-end runs use a real vLLM server (the session's shared one; rank 0 generates for everyone),
micro-batches of 24 rows over 64 completions (3 per step: the ranks get 2 and 1, so the padding
passes run) and 2 optimizer passes per batch (the old-logprob pass is padded too).
"""

import json
import shutil

import pytest
from safetensors.torch import load_file

from driver.cli import ConfigError
from driver.config import Config
from driver.distributed.world import World
from driver.train import check_world
from tests.torchrun_runs import adapter, assert_same_weights, metrics, train, trained_steps


# Evaluated after every step on 8 held-out prompts, the best adapter kept: rank 0 evaluates, every rank joins
# the save (a collective under FSDP) on rank 0's metrics.
EVALUATED = ["--eval.val_set_size=8", "--eval.steps=1", "--eval.save_best=true"]


@pytest.mark.slow
def test_two_processes_train_what_one_trains_and_resume_at_any_world_size(tmp_path, tiny_vllm_server):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, tiny_vllm_server, "--checkpoint.every=1", *EVALUATED)
    train(two, tiny_vllm_server, "--checkpoint.every=1", "--checkpoint.resume=auto", *EVALUATED, processes=2)  # none
    rows_one, rows_two = trained_steps(one), trained_steps(two)
    assert len(rows_one) == len(rows_two) == 3
    evaluations = [row for row in metrics(two) if "eval/version" in row]
    assert [(row["step"], row["eval/prompts"]) for row in evaluations] == [(1, 8.0), (2, 8.0), (3, 8.0)]
    best = json.loads((two / "best" / "best.json").read_text())
    assert best["eval/reward"] == max(row["eval/reward"] for row in evaluations)
    kept = two / "checkpoints" / f"step-{best['step']:06d}"  # (the two newest are kept)
    saved = load_file(two / "best" / "adapter_model.safetensors")
    assert_same_weights(saved, adapter(kept) if kept.is_dir() else saved, atol=0)  # what the ranks held then
    assert saved.keys() == adapter(two).keys()
    for a, b in zip(rows_one, rows_two):
        assert a["reward"] == b["reward"]  # rank 0 generated and scored exactly what one process did
        assert a["filter/kept_sequences"] == b["filter/kept_sequences"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["sync/probe_max_abs_diff"] < 1e-3  # vLLM serves the adapter gathered from the shards
    # Summation order differs (sharded reduce-scatter); AdamW's first steps magnify that on entries with
    # near-zero gradients, so the tolerance is lr / 5: a missed or doubled step moves weights by ~lr.
    assert_same_weights(adapter(one), adapter(two), atol=1e-3)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert sorted(p.name for p in (two / "checkpoints" / "step-000002" / "optimizer").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]

    checkpoint = f"--checkpoint.resume={two / 'checkpoints' / 'step-000002'}"
    resumed_two, resumed_one = tmp_path / "resumed-two", tmp_path / "resumed-one"
    # train.epochs in place of train.steps: 0.09 x 248 prompts / 8 a step = 2.79, the same 3 steps, counted on rank 0
    # and told to rank 1 (which reads no prompts).
    train(resumed_two, tiny_vllm_server, checkpoint, *EVALUATED, "--train.epochs=0.09", processes=2)
    assert [row["step"] for row in trained_steps(resumed_two)] == [3]
    assert trained_steps(resumed_two)[0]["reward"] == rows_two[2]["reward"]
    assert_same_weights(adapter(resumed_two), adapter(two), atol=1e-6)
    train(resumed_one, tiny_vllm_server, checkpoint, *EVALUATED)  # the sharded optimizer state loads in one process
    assert_same_weights(adapter(resumed_one), adapter(two), atol=1e-4)
    # and one process's checkpoint (its optimizer state whole, keyed by position) under torchrun, found by auto (rank
    # 0 finds it and tells rank 1) in the output_dir it was copied to
    from_one = tmp_path / "two-from-one"
    shutil.copytree(one / "checkpoints" / "step-000002", from_one / "checkpoints" / "step-000002")
    train(from_one, tiny_vllm_server, "--checkpoint.resume=auto", *EVALUATED, processes=2)
    assert trained_steps(from_one)[0]["reward"] == rows_one[2]["reward"]
    assert_same_weights(adapter(from_one), adapter(one), atol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"backend": "transformers"}}, "rollout.backend = transformers: under torchrun the model is sharded"),
])
def test_a_torchrun_launch_refuses_what_it_cannot_do_yet(overrides, message):
    config = Config.model_validate({"rollout": {"backend": "server"}, **overrides})
    check_world(config, World(0, 1, 0))  # one process: anything goes
    with pytest.raises(ConfigError, match=message):
        check_world(config, World(1, 2, 1))


@pytest.mark.parametrize("mode, backend", [("structured", "server"), ("strided", "colocate")])
def test_a_torchrun_launch_takes_ebft(mode, backend):
    config = Config.model_validate({"rollout": {"backend": backend}, "algo": {"name": "ebft", "num_generations": 2},
                                    "ebft": {"mode": mode}, "rewards": {}})
    check_world(config, World(1, 2, 1))  # strided has no engine: the backend does not matter
