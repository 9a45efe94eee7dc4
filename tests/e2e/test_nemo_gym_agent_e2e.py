"""NeMo Gym multi-turn end to end: `python -m driver.train` with environment.name = nemo_gym_agent launches its
vLLM server (one set of weights, reloaded in place at every sync, under the base model's name: LoRA with
rollout.weight_sync = merged in the first run, full fine-tuning in the second), then ng_run from the `make
nemo-gym` venv with the package's example_single_tool_call resources server, vllm_model on that vLLM server
and simple_agent; every episode is one /run. Two runs of 2 steps each: they check
the episodes' structure and reward (always 1.0 from this server), not learning.

- Free sampling: the tiny random model writes no tool call, so each episode is one model call, ended by
  max_output_tokens or its end of turn. The trainer scores the /run's token ids, the prompt being the vLLM
  server's own rendering (tools included): in float32 its logprobs must be the ones the server sampled with.
- A grammar (rollout.sampling.structured_outputs, which reaches vLLM through vllm_model's per-request extra_body)
  makes every turn a get_weather call, which the hermes parser reads and the agent runs on the resources server,
  up to max_turns calls. The tiny model's chat template renders no tool calls, so the second call's prompt does
  not extend the first call's tokens: every episode is cut there, as a prefix mismatch (appended environment
  tokens are tested on hand-written /run answers: tests/driver/environments/test_nemo_gym_episode.py). A
  grammar's logprobs are of the constrained distribution: no logprob check there.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver.rewards.nemo_gym_server import DEFAULT_VENV, resources_servers_dir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "ng_run").is_file(),
                                                   reason=f"no NeMo Gym venv at {DEFAULT_VENV}: run `make nemo-gym`")]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
STEPS, PROMPTS, GENERATIONS, MAX_TURNS = 2, 2, 4, 2
TOOL_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(sf|la)"\}\}</tool_call>'


def train(output_dir: Path, *overrides: str) -> list[dict]:
    rows = resources_servers_dir(DEFAULT_VENV) / "example_single_tool_call" / "data" / "example.jsonl"
    command = [
        sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
        "--logging.progress=false", "--logging.plots=false", "--logging.report_to=[]",
        "--train.lr=3e-4", "--rollout.backend=server", "--algo.zero_advantage=keep",
        f"--train.steps={STEPS}", f"--train.prompts_per_step={PROMPTS}", f"--algo.num_generations={GENERATIONS}",
        f"--data.source={rows}", "--data.transform=driver.rewards.nemo_gym.prompt_from_row",
        "--environment.name=nemo_gym_agent", f"--environment.max_turns={MAX_TURNS}",
        "--environment.nemo_gym.resources_server=example_single_tool_call",
        "--rewards.functions=[{path: driver.environments.rewards.environment_reward}]", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "nemo-gym" / "server.log").is_file()
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    assert all(row["rewards/environment_reward/mean"] == 1.0 for row in metrics)  # /run's reward, every episode
    assert all(row["sync/probe_max_abs_diff"] < 1e-3 for row in metrics)  # the server serves the trainer's weights
    return metrics


def test_free_episodes_are_scored_on_the_tokens_the_server_sampled(tmp_path):
    metrics = train(tmp_path / "free", "--rollout.sampling.max_tokens=8", "--rollout.weight_sync=merged")
    for row in metrics:
        assert row["episodes/turns_mean"] == 1 and row["episodes/environment_tokens_mean"] == 0
        assert row["sampling/sampling_logp_difference/max"] < 1e-4  # measured: 4e-6


def test_tool_calls_run_on_the_resources_server_and_extend_the_episode(tmp_path):
    metrics = train(tmp_path / "tools", "--model.adapter=none", "--rollout.sampling.max_tokens=200",
                    "--algo.importance_sampling={level: none}",
                    f"--rollout.sampling.structured_outputs={{regex: '{TOOL_CALL}'}}")
    for row in metrics:
        assert row["tools/call_frequency"] == 1 and row["tools/failure_frequency"] == 0  # the first call, kept
        assert row["episodes/prefix_mismatch_fraction"] == 1 and row["episodes/done_fraction"] == 0
        assert row["episodes/turns_mean"] == 1 and row["episodes/environment_tokens_mean"] == 0
        assert row["completions/clipped_ratio"] == 1  # cut episodes are truncated (mask_truncated_completions)
