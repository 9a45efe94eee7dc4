"""What asynchronous generation and zero-advantage filtering buy in the driver, on CPU.

    .venv/bin/python -m benchmarks.async_in_driver            # ~6 minutes on 2 cores
    .venv/bin/python -m benchmarks.async_in_driver --part filter

A script, not part of the gated suite: whole training runs (vLLM included) are timed.

1. Prefetch: examples/tiny-grpo.yaml with a deliberately slow reward (digit_fraction plus
   SLEEP_PER_COMPLETION seconds per completion, as a remote verifier or a sandboxed test run would
   take), run synchronously with the reward in the trainer's thread, synchronously with two reward
   workers (scoring streams while vLLM generates), and with async prefetch + two workers (the next
   batch generates and scores while the trainer updates). Reported: median time/step over the
   steps after warm-up, and its parts.
2. Filtering: one optimizer step of the tiny policy on a 64-completion batch whose groups are 75%
   zero-signal, unfiltered (micro-batch skip off and on) against filtered: time/update.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, WARMUP = 12, 3
SLEEP_PER_COMPLETION = 0.03  # seconds: 64 completions a step -> 1.9 s of reward per step in one thread
QUIET = ["--logging.progress=false", "--logging.log_completions=0", "--logging.plots=false",
         "--logging.report_to=[]"]
PREFETCH_RUNS = {
    "sync, reward in the trainer": [],
    "sync, 2 reward workers (streaming)": ["--rewards.reward_num_workers=2"],
    "async prefetch, 2 reward workers": ["--rewards.reward_num_workers=2", "--rollout.async_prefetch=true"],
}


def slow_digit_fraction(prompts, completions, **columns):
    from driver.data.toy_tasks import digit_fraction

    time.sleep(SLEEP_PER_COMPLETION * len(completions))
    return digit_fraction(prompts, completions, **columns)


def prefetch() -> None:
    print(f"tiny-grpo, {STEPS} steps, reward sleeps {SLEEP_PER_COMPLETION * 1e3:.0f} ms per completion; "
          f"medians over steps {WARMUP + 1}..{STEPS}")
    print(f"{'run':38} {'time/step':>10} {'generation':>11} {'reward wait':>12} {'update':>8} {'sync':>6}")
    baseline = None
    for name, overrides in PREFETCH_RUNS.items():
        with tempfile.TemporaryDirectory() as output_dir:
            command = [sys.executable, "-m", "driver.train", "examples/tiny-grpo.yaml", f"--train.steps={STEPS}",
                       f"--logging.output_dir={output_dir}",
                       '--rewards.functions=[{"path": "benchmarks.async_in_driver.slow_digit_fraction"}]',
                       *QUIET, *overrides]
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if result.returncode:
                sys.exit(f"{name}: the run failed\n{result.stderr[-3000:]}")
            rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
        rows = rows[WARMUP:]

        def median(key: str, rows: list[dict] = rows) -> float:
            return statistics.median(row.get(key) or 0.0 for row in rows)

        step = median("time/step")
        baseline = baseline or step
        print(f"{name:38} {step:9.2f}s {median('time/generation'):10.2f}s {median('time/reward_wait'):11.2f}s "
              f"{median('time/update'):7.2f}s {median('time/sync'):5.2f}s   {baseline / step:.2f}x")


def filtering() -> None:
    import torch

    from driver.config import Config
    from driver.policy.logprobs import completion_logprobs, pack
    from driver.policy.model import load_policy
    from driver.rollouts.batch import RolloutBatch
    from driver.rollouts.filtering import filter_zero_advantage
    from driver.update.optim import build_optimizer, build_scheduler
    from driver.update.step import optimize

    config = Config.model_validate({"train": {"micro_batch_size": 16}})
    policy = load_policy(config)
    generator = torch.Generator().manual_seed(0)
    groups, size, length = 8, 8, 32
    prompts = [[10 + g, 20, 30, 40 + g] for g in range(groups) for _ in range(size)]
    completions = [torch.randint(40, 300, (length - i % 7,), generator=generator).tolist()
                   for i in range(groups * size)]
    signal_groups = {1, 5}  # 6 of 8 groups (75%) carry no signal, spread as they come
    advantages = torch.tensor([(1.0 if i % 2 else -1.0) if i // size in signal_groups else 0.0
                               for i in range(groups * size)])
    with torch.no_grad():
        logps, _, mask = completion_logprobs(policy.model, pack(prompts, completions))
    batch = RolloutBatch(prompts, completions, logps.clone(), mask, advantages)
    filtered, _ = filter_zero_advantage(batch, config.train.micro_batch_size, beta=0.0)
    cases = {
        "unfiltered, no micro-batch skip": (batch, {"zero_advantage": "keep"}),
        "unfiltered, micro-batch skip": (batch, {"zero_advantage": "skip"}),
        "filtered before the update": (filtered, {}),
    }
    print(f"one update of tiny://qwen2 on {len(batch)} completions, 75% of groups zero-signal, "
          f"micro_batch_size {config.train.micro_batch_size}; median of 7")
    baseline = None
    for name, (rollout, algo) in cases.items():
        run_config = Config.model_validate({"train": {"micro_batch_size": 16}, "algo": algo})
        times = []
        for _ in range(8):
            trial = copy.deepcopy(policy)
            optimizer = build_optimizer(trial.trainable_parameters(), run_config.train)
            scheduler = build_scheduler(optimizer, run_config.train, 10)
            start = time.perf_counter()
            optimize(run_config, trial, rollout, optimizer, scheduler)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        baseline = baseline or seconds
        print(f"{name:34} {seconds * 1e3:8.1f} ms   {baseline / seconds:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("prefetch", "filter", "all"), default="all")
    part = parser.parse_args().part
    if part in ("prefetch", "all"):
        prefetch()
    if part in ("filter", "all"):
        filtering()


if __name__ == "__main__":
    main()
