"""NeMo Gym multi-turn end to end: `python -m driver.train` with environment.name = nemo_gym_agent launches its
vLLM server (full fine-tuning: one set of weights, reloaded in place at every sync, under the base model's
name), then ng_run from the `make nemo-gym` venv with the package's example_single_tool_call resources server,
vllm_model on that vLLM server and simple_agent; every episode is one /run, trained for 2 steps.

The tiny random model writes no tool calls of its own: a grammar (rollout.sampling.structured_outputs, which
reaches vLLM through vllm_model's per-request extra_body) makes each turn either a get_weather call, which the
hermes parser reads and the agent runs on the resources server, or a short answer, which ends the episode.
The test checks the episodes' structure and reward (always 1.0 from this server), not learning: a second model
call is either appended after its environment tokens or, when the vLLM server's chat template rendered the
first one with other tokens than the grammar sampled, cut as a prefix mismatch.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from driver.rewards.nemo_gym_server import DEFAULT_VENV, resources_servers_dir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "ng_run").is_file(),
                                                   reason=f"no NeMo Gym venv at {DEFAULT_VENV}: run `make nemo-gym`")]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
STEPS, PROMPTS, GENERATIONS, MAX_TURNS = 2, 2, 4, 2
TOOL_OR_ANSWER = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "sf"\}\}</tool_call>|[a-z]{1,3}'


def test_nemo_gym_agent_episodes_train(tmp_path):
    rows = resources_servers_dir(DEFAULT_VENV) / "example_single_tool_call" / "data" / "example.jsonl"
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
        "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
        "--logging.log_completions_every=1", "--model.adapter=none", "--train.lr=3e-4",
        "--rollout.backend=server", "--rollout.sampling.max_tokens=160",
        f"--rollout.sampling.structured_outputs={{regex: '{TOOL_OR_ANSWER}'}}",
        "--algo.importance_sampling={level: none}", "--algo.zero_advantage=keep",
        f"--train.steps={STEPS}", f"--train.prompts_per_step={PROMPTS}", f"--algo.num_generations={GENERATIONS}",
        f"--data.source={rows}", "--data.transform=driver.rewards.nemo_gym.prompt_from_row",
        "--environment.name=nemo_gym_agent", f"--environment.max_turns={MAX_TURNS}",
        "--environment.nemo_gym.resources_server=example_single_tool_call",
        "--rewards.functions=[{path: driver.environments.rewards.environment_reward}]"]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    print(f"train: {time.perf_counter() - started:.0f} s")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    for row in metrics:
        assert row["rewards/environment_reward/mean"] == 1.0  # /run's reward, every episode
        assert 1 <= row["episodes/turns_mean"] <= MAX_TURNS
        # Every second model call was either appended or cut: turns = 1 + (the calls after a tool call that
        # extended the sequence); the environment's tokens come only with those.
        extended = row["episodes/turns_mean"] - 1
        assert extended + row["episodes/prefix_mismatch_fraction"] <= row["tools/call_frequency"] + 1e-6
        assert (row["episodes/environment_tokens_mean"] > 0) == (extended > 0)
        assert row["grad_norm"] > 0 and row["sync/probe_verified"] == 1  # the server follows the trained weights
    assert sum(row["tools/call_frequency"] for row in metrics) > 0  # get_weather ran on the resources server
    assert (output_dir / "nemo-gym" / "server.log").is_file()
