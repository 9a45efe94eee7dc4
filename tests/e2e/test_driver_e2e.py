"""End to end on CPU with real vLLM: `python -m driver.train` as users run it (subprocesses).

An engine start costs ~25 s on 2 cores, so the runs share them. One demo run (fp32, colocated, 40
steps, a checkpoint every 3 steps) answers most questions: it learns, writes its outputs, keeps vLLM's
output in run.log and ends with a summary, its adapter is what PEFT and vLLM load, and resuming from
its step-3 checkpoint reproduces its step-6 adapter byte for byte. Runs that only need a server to
talk to use the session's shared fp32 server (tests/conftest.py). bf16 runs check the sync
verification where engine and trainer never agree exactly: a planted stale engine is caught, served
adapters are verified, with MoE (single-weights engine, async prefetch) and with QLoRA on a launched
server.
"""

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import torch

from driver.data.tiny_model import resolve_model_path
from tests.hub_cache import cache_with

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"
MOE_EXAMPLE = ROOT / "examples" / "tiny-moe-grpo.yaml"
ASYNC_EXAMPLE = ROOT / "examples" / "tiny-grpo-async.yaml"  # every sample-efficiency feature on
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.report_to=[]"]
BF16 = ["--model.dtype=bfloat16"]
CHECKPOINT_EVERY = 3


def train(output_dir: Path, *overrides: str, script: list[str] | None = None, timeout: int = 600,
          example: Path = EXAMPLE, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, *(script or ["-m", "driver.train"]), str(example),
               f"--logging.output_dir={output_dir}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def on_server(url: str) -> list[str]:
    return ["--rollout.backend=server", f"--rollout.server_url={url}"]


def metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def verified_versions(rows: list[dict]) -> int:
    return sum(row.get("sync/probe_verified") or 0 for row in rows)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`make demo`'s run, with a checkpoint every 3 steps kept for the resume test."""
    output_dir = tmp_path_factory.mktemp("demo") / "run"
    result = train(output_dir, f"--checkpoint.every={CHECKPOINT_EVERY}", "--checkpoint.keep=20")
    assert_ok(result)
    return output_dir, result


class TestTheDemoRun:
    """Questions one demo run answers (a class: `pytest -n` sends them to one worker, which runs it once)."""

    def test_the_demo_learns_and_writes_its_outputs(self, demo):
        output_dir, _ = demo
        rows = metrics(output_dir)
        rewards = [row["reward"] for row in rows]
        assert len(rows) == 40
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        assert last > first + 0.3, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
        assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
        # (steps whose micro-batches were all skipped for zero advantage score nothing, so no gap)
        gaps = [row["sampling/sampling_logp_difference/max"] for row in rows
                if row.get("sampling/sampling_logp_difference/max") is not None]
        assert len(gaps) >= 20 and max(gaps) < 1e-3
        for name in ("config.yaml", "run.log", "adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                     "plots/reward.png", "plots/overview.png"):
            assert (output_dir / name).is_file(), name
        assert list((output_dir / "tensorboard").glob("events.out.tfevents.*"))
        assert (output_dir / "checkpoints" / "step-000040").is_dir()


    def test_the_demo_keeps_the_terminal_quiet_and_ends_with_a_summary(self, demo):
        output_dir, result = demo
        terminal = result.stdout + result.stderr
        for noise in ("EngineCore", "WARNING", "Triton", "kernels-community"):  # vLLM's, transformers', bnb's
            assert noise not in terminal, noise
        # vLLM's records went to run.log instead: from its engine-core process (EngineCore_DP0) or, with the
        # default merged weight sync, from the engine running in this process (MainProcess).
        run_log = (output_dir / "run.log").read_text()
        assert re.search(r"\((EngineCore\S*|MainProcess) pid=\d+\) (INFO|WARNING) ", run_log)
        # Before the first step, a line per phase, in the order they ran (the log's path first: where
        # to look while they run).
        startup = result.stdout[:result.stdout.index("finished step 40 of 40")]
        at = [startup.index(line) for line in ("vLLM's and the libraries' output:", "loaded tiny://qwen2 (",
                                               "trainable parameters) in ", "read 256 prompts (toy:digits) in ",
                                               "started vLLM in ")]
        assert at == sorted(at)
        summary = result.stdout[result.stdout.index("finished step 40 of 40"):]
        minutes, seconds = re.search(r"in (\d+)m(\d\d)s", summary.splitlines()[0]).groups()
        assert 60 * int(minutes) + int(seconds) >= sum(row["time/step"] for row in metrics(output_dir)) - 1
        assert "reward: first 10 steps" in summary
        for path in ("adapter", "metrics.jsonl", "plots", "tensorboard", "run.log"):
            assert str(output_dir / path) in summary, path
        assert f"-m driver.train {output_dir / 'config.yaml'} --checkpoint.resume=latest --train.steps=80" in summary


    def test_the_saved_adapter_is_what_peft_and_vllm_load(self, demo, tiny_vllm_server):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        adapter = demo[0] / "adapter"
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"))
        model = PeftModel.from_pretrained(base, adapter)
        ids = list(range(40, 70))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
            with model.disable_adapter():
                base_logits = model(torch.tensor([ids])).logits[0, :-1]
        targets = torch.tensor(ids[1:])[:, None]
        peft_logprobs = torch.log_softmax(logits, -1).gather(1, targets)[:, 0]
        base_logprobs = torch.log_softmax(base_logits, -1).gather(1, targets)[:, 0]
        assert (base_logprobs - peft_logprobs).abs().max() > 1e-3  # the adapter learned something to compare
        name = f"e2e-saved-{secrets.token_hex(4)}"  # vLLM's own HTTP API, not the driver's client
        requests.post(f"{tiny_vllm_server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)},
                      timeout=120).raise_for_status()
        try:
            response = requests.post(f"{tiny_vllm_server}/v1/completions", timeout=120, json={
                "model": name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
            response.raise_for_status()
        finally:
            requests.post(f"{tiny_vllm_server}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120)
        entries = response.json()["choices"][0]["prompt_logprobs"][1:]
        vllm_logprobs = torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])])
        torch.testing.assert_close(vllm_logprobs, peft_logprobs, atol=1e-4, rtol=0)


    def test_the_merged_model_is_what_vllm_serves_with_the_adapter(self, demo, tiny_vllm_server, tmp_path):
        """python -m driver.merge_lora on the demo's run: the shared server reloads its weights from the
        merged directory (vLLM's own loader, through /collective_rpc) and scores as PEFT does with the
        adapter; then it gets the base back."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        merged = tmp_path / "merged"
        result = subprocess.run([sys.executable, "-m", "driver.merge_lora", str(demo[0]), "--out", str(merged)],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert_ok(result)
        base_dir = resolve_model_path("tiny://qwen2")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), demo[0] / "adapter")
        ids = list(range(40, 70))
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        peft_logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

        def reload(weights: Path) -> None:
            requests.post(f"{tiny_vllm_server}/collective_rpc", timeout=300, json={
                "method": "reload_weights", "kwargs": {"weights_path": str(weights)}}).raise_for_status()
            requests.post(f"{tiny_vllm_server}/reset_prefix_cache", timeout=60).raise_for_status()

        reload(merged)
        try:
            response = requests.post(f"{tiny_vllm_server}/v1/completions", timeout=120, json={
                "model": base_dir, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
            response.raise_for_status()
        finally:
            reload(Path(base_dir))
        entries = response.json()["choices"][0]["prompt_logprobs"][1:]
        vllm_logprobs = torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries, ids[1:])])
        torch.testing.assert_close(vllm_logprobs, peft_logprobs, atol=1e-4, rtol=0)

    def test_a_run_started_from_the_demos_adapter_starts_where_it_left_off(self, demo, tiny_vllm_server, tmp_path):
        """lora.init_from (TRL's PeftModel.from_pretrained, axolotl's lora_model_dir) the demo's adapter: the server
        samples the first step with it (a fresh adapter would score as the demo's first steps did), and the
        trainer's logprobs of those samples are the engine's, so both hold the same adapter."""
        adapter = demo[0] / "adapter"
        output_dir = tmp_path / "run"
        result = train(output_dir, *QUIET, *on_server(tiny_vllm_server), f"--lora.init_from={adapter}",
                       "--train.steps=2")
        assert_ok(result)
        assert f"loaded tiny://qwen2 with the adapter {adapter}" in result.stdout.replace("\n", "")
        rows, demo_rows = metrics(output_dir), metrics(demo[0])
        first, last = (sum(row["reward"] for row in part) / len(part) for part in (demo_rows[:10], demo_rows[-10:]))
        assert rows[0]["reward"] > (first + last) / 2
        # (a step whose groups all scored alike trains on nothing and has no logprob to compare)
        gaps = [row["sampling/sampling_logp_difference/max"] for row in rows
                if row.get("sampling/sampling_logp_difference/max") is not None]
        assert all(gap < 1e-3 for gap in gaps)

    def test_resuming_a_checkpoint_is_exact(self, demo, tmp_path):
        """3 steps, then resume to 6, gives the bytes of 6 steps straight (the demo's step-6 checkpoint)."""
        demo_dir = demo[0]
        resumed = tmp_path / "resumed"
        checkpoint = demo_dir / "checkpoints" / f"step-{CHECKPOINT_EVERY:06d}"
        assert_ok(train(resumed, f"--checkpoint.resume={checkpoint}", f"--train.steps={2 * CHECKPOINT_EVERY}", *QUIET))
        straight = (demo_dir / "checkpoints" / f"step-{2 * CHECKPOINT_EVERY:06d}" / "adapter"
                    / "adapter_model.safetensors")
        assert (resumed / "adapter" / "adapter_model.safetensors").read_bytes() == straight.read_bytes()
        assert [row["reward"] for row in metrics(resumed)] == [
            row["reward"] for row in metrics(demo_dir)[CHECKPOINT_EVERY:2 * CHECKPOINT_EVERY]]


@pytest.mark.parametrize(("overrides", "signum"), [
    ([], signal.SIGINT),
    (["--rollout.async_prefetch=true", "--rewards.reward_num_workers=1"], signal.SIGTERM),  # docker stop, SLURM
], ids=["sync-ctrl-c", "async-sigterm"])
def test_ctrl_c_or_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, overrides, signum, tiny_vllm_server):
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "driver.train", str(EXAMPLE), f"--logging.output_dir={output_dir}",
               "--train.steps=1000", *QUIET, *on_server(tiny_vllm_server), *overrides]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not ((output_dir / "metrics.jsonl").exists()
                                          and len(metrics(output_dir)) >= 2):
        time.sleep(0.5)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-3000:]  # 130, 143: the shell's convention
    assert "Traceback" not in stderr
    said = "interrupt" if signum == signal.SIGINT else "SIGTERM"
    assert f"{said}: stopping after this step" in stdout and "resume:" in stdout
    checkpoints = sorted((output_dir / "checkpoints").iterdir())
    state = torch.load(checkpoints[-1] / "trainer_state.pt", weights_only=False)
    assert state["step"] == len(metrics(output_dir)) >= 2


def test_async_run_learns_with_every_sample_efficiency_mechanism_firing(tmp_path):
    """Also evaluated on 16 prompts held out of the data, before the first step and every 20 steps, while the
    prefetch thread generates (the evaluation holds the engine between its jobs)."""
    # Colocated: partial rollouts make many small requests, which take twice as long over HTTP.
    output_dir = tmp_path / "run"
    result = train(output_dir, *QUIET, "--eval.val_set_size=16", "--eval.steps=20", "--eval.on_start=true",
                   example=ASYNC_EXAMPLE)
    assert_ok(result)
    lines = metrics(output_dir)
    rows = [row for row in lines if "eval/version" not in row]
    evaluations = [row for row in lines if "eval/version" in row]
    check_evaluations(output_dir, evaluations, result.stdout)
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
    assert empty and not any(row.get("entropy") is not None for row in empty)


def check_evaluations(output_dir: Path, evaluations: list[dict], stdout: str) -> None:
    """The async run's evaluations: each by the adapter of its step, on prompts never trained on, their reward
    the reward function's over the completions they logged, and rising as the policy learns."""
    from driver.data.toy_tasks import digit_fraction_steps, toy_dataset

    assert [(row["step"], row["eval/version"], row["eval/prompts"]) for row in evaluations] == [
        (0, 0.0, 16.0), (20, 20.0, 16.0), (40, 40.0, 16.0)]
    assert "eval after step 20: reward " in stdout and "eval/reward: " in stdout
    logged = [json.loads(line) for line in (output_dir / "eval_completions.jsonl").read_text().splitlines()]
    for row in evaluations:
        completions = [line for line in logged if line["step"] == row["step"]]
        assert len(completions) == 16 * 8
        oracle = digit_fraction_steps([c["prompt"] for c in completions], [c["completion"] for c in completions])
        assert row["eval/reward"] == pytest.approx(sum(oracle) / len(oracle), abs=1e-6)
    held_out = {line["prompt"] for line in logged}
    trained = {json.loads(line)["prompt"] for line in (output_dir / "completions.jsonl").read_text().splitlines()}
    texts = Counter(row["prompt"] for row in toy_dataset("digits"))  # a few texts are two rows
    assert len(held_out) == 16 and trained and held_out & trained <= {text for text, n in texts.items() if n > 1}
    assert evaluations[-1]["eval/reward"] > evaluations[0]["eval/reward"] + 0.3


def test_chat_data_with_trls_loss_and_sampling_knobs_learns(tmp_path, tiny_vllm_server):
    """Conversations (toy:digits-chat, ChatML) scored by a reward that insists on message lists, under
    cispo + RLOO + mask_truncated_completions + min_p + repetition_penalty + a stop string + DAPO's dynamic
    sampling: completions end at the first space, truncated ones carry no loss, every step trains on groups
    with signal only, and the reward still climbs within a few steps."""
    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, *QUIET, *on_server(tiny_vllm_server), "--data.source=toy:digits-chat",
                    "--rewards.functions=[{path: tests.reward_fixtures.conversational_digit_fraction}]",
                    "--algo.loss_type=cispo", "--algo.advantage_estimator=rloo",
                    "--algo.mask_truncated_completions=true", "--rollout.sampling.min_p=0.02",
                    "--rollout.sampling.repetition_penalty=1.05", "--rollout.sampling.stop=[' ']",
                    "--algo.dynamic_sampling=true", "--algo.dynamic_sampling_max_rounds=1", "--train.steps=12"))
    rows = metrics(output_dir)
    assert len(rows) == 12
    # Steps that found groups with signal trained on those only; once the task is solved (every group
    # all 1.0) the extra rounds run out and the step is assembled as without dynamic sampling.
    found = [row for row in rows if row["dynamic_sampling/groups_with_signal"] > 0]
    assert found and all(row["frac_reward_zero_std"] == 0 for row in found)
    assert any(row["dynamic_sampling/rounds"] > 0 for row in rows)
    assert all(row["dynamic_sampling/rounds"] <= 1 for row in rows)  # dynamic_sampling_max_rounds
    assert rows[0]["completions/clipped_ratio"] > 0  # some completions were cut at max_tokens: masked
    first, last = sum(r["reward"] for r in rows[:3]) / 3, sum(r["reward"] for r in rows[-3:]) / 3
    assert last > first + 0.4, f"reward did not rise: first 3 steps {first:.3f}, last 3 {last:.3f}"
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3  # the knobs left the IS exact


def test_the_transformers_backend_learns_without_vllm_with_exact_sampling_logprobs(tmp_path):
    """rollout.backend: transformers (TRL's use_vllm=False): no engine, no adapter saved per step, and the
    sampling logprobs equal the trainer's to float32 rounding (the first update of each batch sees the
    weights that sampled it)."""
    output_dir = tmp_path / "run"
    result = train(output_dir, *QUIET, "--rollout.backend=transformers", "--train.steps=24")
    assert_ok(result)
    assert "read 256 prompts" in result.stdout and "started vLLM" not in result.stdout  # no engine starts
    rows = metrics(output_dir)
    first, last = sum(r["reward"] for r in rows[:5]) / 5, sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.3, f"reward did not rise: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert max(row["sampling/sampling_logp_difference/max"] for row in rows) < 1e-4
    assert not (output_dir / "adapters").exists()


def test_a_hub_model_id_trains_from_the_hugging_face_cache(tmp_path):
    """model.path as TRL and axolotl users write it, a Hub id, found here in an offline cache laid out as
    huggingface_hub writes one (HF_HUB_OFFLINE=1): the trainer and vLLM load its snapshot, the syncs are
    verified, and the adapter names the Hub id as its base, not this machine's cache."""
    snapshot = cache_with(tmp_path / "hub", "acme/tiny-qwen2", {"main": "c" * 40})["c" * 40]
    output_dir = tmp_path / "run"
    result = train(output_dir, *QUIET, "--model.path=acme/tiny-qwen2", "--train.steps=2",
                   env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert_ok(result)
    assert f"fetched acme/tiny-qwen2 ({snapshot})" in result.stdout.replace("\n", "")
    rows = metrics(output_dir)
    assert len(rows) == 2 and max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-3
    adapter = json.loads((output_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "acme/tiny-qwen2"


def test_full_finetuning_pushes_every_weight_and_the_probe_follows(tmp_path):
    """model.adapter: none, colocated: all weights train, every sync loads them into the engine in place and
    the probe finds the engine on them (fp32: exactly), the KL is against a frozen copy of the base, and the
    output is a model directory transformers loads."""
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "run"
    assert_ok(train(output_dir, *QUIET, "--model.adapter=none", "--algo.beta=0.04", "--train.lr=3e-4",
                    "--train.steps=5"))
    rows = metrics(output_dir)
    assert len(rows) == 5 and verified_versions(rows) == 5  # the start version is pushed before step 1
    assert max(row["sync/probe_max_abs_diff"] for row in rows) < 1e-4
    assert rows[-1]["kl"] > rows[1]["kl"] > 0
    trained = AutoModelForCausalLM.from_pretrained(output_dir / "model", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2"), dtype=torch.float32)
    moved = [name for (name, a), b in zip(trained.named_parameters(), base.parameters()) if not torch.equal(a, b)]
    assert len(moved) == len(list(base.parameters()))  # every weight trained, embeddings and norms too
    assert not (output_dir / "adapter").exists()


class TestBf16:
    """bf16 runs, where engine and trainer never agree exactly (a class: one unit of work for `pytest -n`)."""

    def test_bf16_syncs_are_verified_and_a_stale_engine_is_caught(self, tmp_path):
        """bf16 kernels of vLLM and transformers differ by ~0.05 per probe token on the same weights: the
        check must pass the versions really served and stop the run once the engine stops following."""
        output_dir = tmp_path / "run"
        result = train(output_dir, *BF16, "--train.steps=16", *QUIET, script=["tests/e2e/plant_stale_sync.py"],
                       env={"STALE_FROM": "6"})
        assert result.returncode == 1, result.stderr[-3000:]
        assert "the engine is not serving the weights just saved" in result.stderr
        rows = metrics(output_dir)
        assert verified_versions(rows[:5]) >= 2  # versions 1-5 were served, and checked as such
        assert "Traceback" not in result.stderr


    def test_bf16_moe_with_async_prefetch_trains_experts_lora_on_a_single_weights_engine(self, tmp_path):
        """MoE on CPU: vLLM's LoRA path needs Triton, so the engine gets merged weights each sync; version v
        may replace the weights only after every batch of an older version finished (prefetch depth 2)."""
        output_dir = tmp_path / "run"
        result = train(output_dir, *BF16, "--train.steps=5", "--rollout.async_prefetch=true",
                       "--rollout.prefetch_depth=2", *QUIET, example=MOE_EXAMPLE)
        assert_ok(result)
        assert "grouped MoE kernels on 2 experts modules" in result.stdout
        rows = metrics(output_dir)
        assert [row["rollout/version"] for row in rows] == [0, 0, 0, 1, 2]
        assert verified_versions(rows) >= 1
        adapter = json.loads((output_dir / "adapter" / "adapter_config.json").read_text())
        assert sorted(adapter["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


    def test_bf16_qlora_on_a_launched_server_serves_the_round_tripped_base_and_stops_the_server(self, tmp_path):
        """The 30B example's set-up in miniature: an NF4 trainer, a vLLM server it launches serving the NF4
        round trip of the bf16 base + adapter: the base the adapter trains against, so sampling and trainer
        logprobs differ by bf16 noise only (0.35 nats per token when vLLM served the unquantized base)."""
        import psutil

        output_dir = tmp_path / "run"
        result = train(output_dir, *BF16, "--model.qlora=true", "--rollout.backend=server", "--train.steps=6", *QUIET)
        assert_ok(result)
        assert "launched a vLLM server in " in result.stdout
        rows = metrics(output_dir)
        assert len(rows) == 6 and verified_versions(rows) >= 2
        assert max(row["sampling/sampling_logp_difference/mean"] for row in rows) < 0.05  # dense bf16: ~0.013
        assert "nf4-bases" in (output_dir / "vllm-server.log").read_text()  # the launch command's --model
        assert (output_dir / "vllm-server.log").stat().st_size > 0
        launched = [p for p in psutil.process_iter(["cmdline"])  # (the shared server serves float32)
                    if "vllm.entrypoints.openai.api_server" in (p.info["cmdline"] or [])
                    and "bfloat16" in (p.info["cmdline"] or [])]
        assert not launched, "the run left its vLLM server running"
