"""Launching the driver under torchrun for the distributed tests: one process or N (gloo on CPU), on the
tiny examples, and reading back what the run wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
EBFT = ROOT / "examples" / "tiny-ebft.yaml"
EBFT_STRIDED = ROOT / "examples" / "tiny-ebft-strided.yaml"
RUN = ["--train.steps=3", "--train.micro_batch_size=24", "--algo.num_iterations=2",
       "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
       "--logging.log_completions=0"]


def train(output_dir: Path, server_url: str | None, *overrides: str, processes: int = 1,
          example: Path = EXAMPLE, env: dict[str, str] | None = None) -> None:
    """server_url None: a mode without an engine (EBFT strided). env: added to the run's environment."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
                if processes > 1 else [sys.executable])
    engine = [] if server_url is None else ["--rollout.backend=server", f"--rollout.server_url={server_url}"]
    command = [*launcher, "-m", "driver.train", str(example), f"--logging.output_dir={output_dir}", *RUN, *engine,
               *overrides]
    # One thread per rank: two ranks on two cores, and the same summation order in every run.
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert result.returncode == 0, result.stderr[-4000:]


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def trained_steps(output_dir: Path) -> list[dict]:
    """The metrics of the training steps (an evaluation's rows left out)."""
    return [row for row in metrics(output_dir) if "eval/version" not in row]


def adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "adapter" / "adapter_model.safetensors")


def model(output_dir: Path) -> dict[str, torch.Tensor]:
    """Full fine-tuning's trained model."""
    return load_file(output_dir / "model" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)
