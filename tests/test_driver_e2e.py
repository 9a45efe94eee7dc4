"""End to end on CPU with real vLLM: `python -m driver.train` as users run it (subprocesses).

Each run starts a vLLM engine (~30 s here), so the runs are few and short; together they check
that the tiny GRPO run learns, that its outputs are complete, that the saved adapter is what PEFT
and vLLM load, that resume is exact, that Ctrl-C checkpoints, that QLoRA runs, and that a stale
adapter sync is caught.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from driver.tiny_model import resolve_model_path

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
MOE_EXAMPLE = ROOT / "examples" / "tiny-moe-grpo.yaml"
ASYNC_EXAMPLE = ROOT / "examples" / "tiny-grpo-async.yaml"  # every sample-efficiency feature on
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.tensorboard=false"]


def train(output_dir: Path, *overrides: str, script: list[str] | None = None, timeout: int = 600,
          example: Path = EXAMPLE):
    command = [sys.executable, *(script or ["-m", "driver.train"]), str(example),
               f"--logging.output_dir={output_dir}", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return result


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def test_tiny_grpo_learns_and_writes_its_outputs(tmp_path):
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, "--logging.progress=false"))
    rows = metrics(output_dir)
    rewards = [row["reward"] for row in rows]
    assert len(rows) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    # (steps whose micro-batches were all skipped for zero advantage score nothing, so no gap)
    gaps = [row["sampling/sampling_logp_difference/max"] for row in rows if "sampling/sampling_logp_difference/max" in row]
    assert len(gaps) >= 20 and max(gaps) < 1e-3
    for name in ("config.yaml", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "plots/reward.png", "plots/overview.png"):
        assert (output_dir / name).is_file(), name
    assert list((output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["step-000040"]


def test_saved_adapter_loads_in_peft_and_vllm(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, "--train.steps=3", *QUIET))
    model_dir = resolve_model_path("tiny://qwen2")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), output_dir / "adapter")
    ids = list(range(40, 70))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    peft_logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    served = subprocess.run([sys.executable, "tests/e2e/vllm_adapter_logprobs.py", model_dir,
                             str(output_dir / "adapter"), ",".join(map(str, ids))],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert served.returncode == 0, served.stderr[-2000:]
    line = next(line for line in served.stdout.splitlines() if line.startswith("LOGPROBS "))
    vllm_logprobs = torch.tensor(json.loads(line[len("LOGPROBS "):]))
    torch.testing.assert_close(vllm_logprobs, peft_logprobs, atol=1e-4, rtol=0)
    with torch.no_grad(), model.disable_adapter():
        base_logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
    assert (base_logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0] - peft_logprobs).abs().max() > 1e-3


def test_resume_is_exact(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--train.steps=6", "--checkpoint.every=3", *QUIET]
    assert_ok(train(straight, *common))
    assert_ok(train(split, *common[1:], "--train.steps=3"))
    assert_ok(train(split, *common, "--checkpoint.resume=latest"))
    straight_bytes = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    assert (split / "adapter" / "adapter_model.safetensors").read_bytes() == straight_bytes
    assert [r["reward"] for r in metrics(split)] == [r["reward"] for r in metrics(straight)]


@pytest.mark.parametrize("overrides", [[], ["--rollout.async_prefetch=true", "--rewards.reward_num_workers=1"]],
                         ids=["sync", "async"])
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path, overrides):
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
               "--train.steps=1000", *QUIET, *overrides]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((output_dir / "metrics.jsonl").exists()
                                          and len(metrics(output_dir)) >= 2):
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    checkpoints = sorted((output_dir / "checkpoints").iterdir())
    state = torch.load(checkpoints[-1] / "trainer_state.pt", weights_only=False)
    assert state["step"] == len(metrics(output_dir)) >= 2


def test_async_run_learns_with_every_sample_efficiency_mechanism_firing(tmp_path):
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, *QUIET, example=ASYNC_EXAMPLE))
    rows = metrics(output_dir)
    rewards = [row["reward"] for row in rows]
    assert len(rows) == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"

    def total(key):
        return sum(row.get(key) or 0 for row in rows)

    assert max(row.get("rollout/staleness_max") or 0 for row in rows) >= 1  # prefetched: sampled a version back
    assert max(row["rollout/version"] for row in rows) < 39
    assert total("partial/continued_samples") > 0 and total("completions/continued_fraction") > 0
    assert total("rollout/dropped_stale") > 0  # partial groups that waited too long
    assert total("filter/filtered_sequences") > 0 and max(row["frac_reward_zero_std"] for row in rows) == 1.0
    assert total("replay/replayed_groups") > 0
    assert rows[-1]["reroll/rerolled"] > 0
    assert rows[-1]["rewards/worker_restarts"] == 0 and total("rewards/failed_groups") == 0
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    # Empty batches (every group filtered, none replayed) run no forward pass: no per-token metric.
    empty = [row for row in rows if row["filter/kept_sequences"] == 0 and not row.get("replay/replayed_groups")]
    assert empty and not any("entropy" in row for row in empty)


def test_async_prefetch_on_a_single_weights_engine_waits_for_older_jobs_before_a_push(tmp_path):
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, "--train.steps=5", "--rollout.async_prefetch=true", "--rollout.prefetch_depth=2",
                    *QUIET, example=MOE_EXAMPLE))
    rows = metrics(output_dir)
    assert [row["rollout/version"] for row in rows] == [0, 0, 0, 1, 2]
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3


def test_qlora_runs_and_verifies_syncs(tmp_path):
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, "--model.qlora=true", "--train.steps=4", *QUIET))
    rows = metrics(output_dir)
    assert len(rows) == 4
    # vLLM samples from the unquantized base; the trainer's NF4 base differs and IS sees the gap.
    assert rows[0]["sampling/sampling_logp_difference/max"] > 1e-4
    assert sum("sync/probe_change_cosine" in row for row in rows) >= 2


def test_stale_adapter_sync_is_detected(tmp_path):
    result = train(tmp_path / "run", "--train.steps=3", *QUIET, script=["tests/e2e/plant_stale_sync.py"])
    assert result.returncode != 0
    assert "the engine is not serving the weights just saved" in result.stderr


def test_server_backend_learns_the_same_way(tmp_path):
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, "--rollout.backend=server", "--train.steps=4", *QUIET))
    rows = metrics(output_dir)
    assert len(rows) == 4 and max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    assert (output_dir / "vllm-server.log").stat().st_size > 0


def test_moe_example_trains_experts_lora_on_the_grouped_kernels_with_weight_sync(tmp_path):
    output_dir = tmp_path / "run"
    result = train(output_dir, "--train.steps=4", *QUIET, example=MOE_EXAMPLE)
    assert_ok(result)
    assert "grouped MoE kernels on 2 experts modules" in result.stdout
    rows = metrics(output_dir)
    # vLLM serves the merged weights; its probe logprobs match the trainer's (kernel forward).
    assert len(rows) == 4 and max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    adapter = json.loads((output_dir / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
