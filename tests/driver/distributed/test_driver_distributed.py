"""Training under torchrun on CPU (gloo, FSDP2): 2 processes train the adapter 1 process trains on the
same global batch, checkpoints resume exactly, at the same or another world size; and what a
torchrun launch cannot do yet is refused up front.

The end-to-end runs use a real vLLM server (the session's shared one; rank 0 generates for everyone),
micro-batches of 24 rows over 64 completions (3 per step: the ranks get 2 and 1, so the padding
passes run) and 2 optimizer passes per batch (the old-logprob pass is padded too).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from driver.cli import ConfigError
from driver.config import Config
from driver.distributed.world import World
from driver.train import check_world

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
RUN = ["--rollout.backend=server", "--train.steps=3", "--train.micro_batch_size=24", "--algo.num_iterations=2",
       "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
       "--logging.log_completions=0"]


def train(output_dir: Path, server_url: str, *overrides: str, processes: int = 1) -> None:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                if processes > 1 else [sys.executable])
    command = [*launcher, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}", *RUN,
               f"--rollout.server_url={server_url}", *overrides]
    # One thread per rank: two ranks on two cores, and the same summation order in every run.
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "adapter" / "adapter_model.safetensors")


def assert_same_adapter(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


@pytest.mark.slow
def test_two_processes_train_what_one_trains_and_resume_at_any_world_size(tmp_path, tiny_vllm_server):
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, tiny_vllm_server)
    train(two, tiny_vllm_server, "--checkpoint.every=1", processes=2)
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two) == 3
    for a, b in zip(rows_one, rows_two):
        assert a["reward"] == b["reward"]  # rank 0 generated and scored exactly what one process did
        assert a["filter/kept_sequences"] == b["filter/kept_sequences"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-6)
        assert b["sync/probe_max_abs_diff"] < 1e-3  # vLLM serves the adapter gathered from the shards
    # Summation order differs (sharded reduce-scatter); AdamW's first steps magnify that on entries with
    # near-zero gradients, so the tolerance is lr / 5: a missed or doubled step moves weights by ~lr.
    assert_same_adapter(adapter(one), adapter(two), atol=1e-3)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert sorted(p.name for p in (two / "checkpoints" / "step-000002" / "optimizer").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]

    checkpoint = f"--checkpoint.resume={two / 'checkpoints' / 'step-000002'}"
    resumed_two, resumed_one = tmp_path / "resumed-two", tmp_path / "resumed-one"
    train(resumed_two, tiny_vllm_server, checkpoint, processes=2)
    assert [row["step"] for row in metrics(resumed_two)] == [3]
    assert metrics(resumed_two)[0]["reward"] == rows_two[2]["reward"]
    assert_same_adapter(adapter(resumed_two), adapter(two), atol=1e-6)
    train(resumed_one, tiny_vllm_server, checkpoint)  # the sharded optimizer state loads in one process as well
    assert_same_adapter(adapter(resumed_one), adapter(two), atol=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"algo": {"name": "ebft", "num_generations": 2}, "rewards": {}}, "algo.name = ebft runs in one process"),
    ({"rollout": {"backend": "colocate"}}, "rollout.backend = colocate: under torchrun vLLM runs as a server"),
])
def test_a_torchrun_launch_refuses_what_it_cannot_do_yet(overrides, message):
    config = Config.model_validate({"rollout": {"backend": "server"}, **overrides})
    check_world(config, World(0, 1, 0))  # one process: anything goes
    with pytest.raises(ConfigError, match=message):
        check_world(config, World(1, 2, 1))
