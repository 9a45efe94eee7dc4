"""A reasoning-gym task end to end: `python -m driver.train examples/tiny-grpo.yaml` with
data.source reasoning_gym:basic_arithmetic and its verifier as the reward, scored in a reward worker
process, on the session's vLLM server (tests/conftest.py). The tiny random model answers nothing
right: the check is that every completion got the task's score (finite, in [0, 1])."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
STEPS, PROMPTS, GENERATIONS = 2, 4, 4


def test_a_grpo_run_on_a_reasoning_gym_task_is_scored_by_its_verifier(tmp_path, tiny_vllm_server):
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
               "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
               "--logging.log_completions_every=1", "--rollout.backend=server",
               f"--rollout.server_url={tiny_vllm_server}", f"--train.steps={STEPS}",
               f"--train.prompts_per_step={PROMPTS}", f"--algo.num_generations={GENERATIONS}",
               "--data.source=reasoning_gym:basic_arithmetic?size=16&seed=1&system_prompt=direct",
               "--rewards.functions=[{path: driver.rewards.reasoning_gym.score}]", "--rewards.reward_num_workers=1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    assert all(0 <= row["rewards/score/mean"] <= 1 and math.isfinite(row["reward"]) for row in metrics)
    assert all(row.get("rewards/failed_groups", 0) == 0 for row in metrics)
    logged = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    assert logged and all(0 <= row["rewards/score"] <= 1 for row in logged)  # none left None (null)
    assert all("<answer>" in row["prompt"] for row in logged)  # the system prompt asks for the tag
