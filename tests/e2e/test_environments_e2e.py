"""Tool-calling episodes end to end: `python -m driver.train examples/tiny-tools-grpo.yaml` on the session's
vLLM server (tests/conftest.py), the tiny model calling add(a, b) through vLLM's hermes parser."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-tools-grpo.yaml"


def train(output_dir: Path, server_url: str, *overrides: str) -> list[dict]:
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
               "--rollout.backend=server", f"--rollout.server_url={server_url}", "--train.steps=3",
               "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
               "--logging.log_completions_every=1", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_tool_calling_episodes_train(tmp_path, tiny_vllm_server):
    output_dir = tmp_path / "tools"
    rows = train(output_dir, tiny_vllm_server)
    assert len(rows) == 3
    assert all(row["tools/call_frequency"] > 0 for row in rows)  # the model called add in every step
    assert max(row["episodes/turns_max"] for row in rows) >= 2  # and went on after a tool result
    assert all(row["episodes/environment_tokens_mean"] > 0 for row in rows)
    assert all("rewards/sum_reward/mean" in row for row in rows) and max(row["grad_norm"] for row in rows) > 0
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    logged = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    assert any("<tool_call>" in row["completion"] for row in logged)


def test_episodes_run_with_async_prefetch(tmp_path, tiny_vllm_server):
    """The next batch's episodes are generated a version ahead while the trainer updates. (Partial rollouts
    with episodes are tested with a scripted engine: this example's grammar cannot be continued.)"""
    rows = train(tmp_path / "async", tiny_vllm_server, "--rollout.async_prefetch=true")
    # A step whose groups were all filtered (equal rewards) trains on nothing and has no staleness to report.
    assert max(row.get("rollout/staleness_max", 0) for row in rows) >= 1
    assert sum(row["tools/call_frequency"] for row in rows) > 0
