"""make gpu-driver-runs: the driver's own runs on the GPU (`python -m driver.train`), which the other stages
never make: they test and time the ops alone. Each run trains with our CUDA kernels forced
(train.kernels: ours, so no autotune picks torch for a tiny shape) in bfloat16, generating with the
trainer's model (rollout.backend: transformers: the lent nodes have no vLLM).

- lora, qlora, moe, qlora-moe, ebft, full: the tiny examples (dense LoRA, the NF4 base, LoRA on the experts
  of the tiny Qwen3-MoE, the same on NF4 experts, EBFT's feature matching, full fine-tuning). Checked: exit
  status 0, a metrics line per step, loss and grad_norm finite on every step, and, at 20 steps or more, the
  mean reward of the last 10 steps above the first 10's (EBFT: its feature-matching loss below). The tiny
  task is learnt inside 40 steps: on CPU in float32 the LoRA run goes from 0.05 to 1.00.
- speed-ours, speed-torch: a few steps of a model with Qwen2.5-1.5B's layer shapes and 4 of its layers,
  our kernels against torch's (PEFT's LoRA, torch's logprobs), completions of up to 256 tokens (~10k tokens a
  step: at the examples' 16, on an H200 on 2026-11-29, launches and host work decided the update, 0.97x): the
  medians of time/update after the first two steps (the kernels' first calls) are the driver's end-to-end
  speed-up of the update; the table's "first updates" column has those two steps' time (ours took ~15 s
  more than torch's there).
- lora-fp16: the LoRA run in float16 (dynamic loss scaling; the others are bfloat16).

A table per run (wall time, medians of time/step, time/generation, time/update, the first two steps' time/update,
the update's peak memory, reward first -> last 10 steps) ends the stage; outputs stay in build/gpu-driver/<run>.

    python .ci/gpu/driver_runs.py [--dry-run] [--runs lora,qlora,...] [--steps 40] [--device cuda]
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import NamedTuple

import stage

from benchmarks.trl_step import QUIET  # no progress bar, trackers, plots, completions or checkpoints

OUTPUT_DIR = stage.BUILD_DIR / "gpu-driver"
EXAMPLES = stage.ROOT / "examples"
LEARNT_OVER = 10  # steps averaged at each end of a run for the learning check
WARM_STEPS = 2  # steps of a speed run left out of its medians: the kernels' first calls
SPEED_SHAPE, SPEED_LAYERS, SPEED_STEPS = "qwen2.5-1.5b", 4, 8
SPEED_TOKENS = "--rollout.sampling.max_tokens=256"  # the tiny tokenizer's 384 tokens: most run to the limit


class Run(NamedTuple):
    config: str  # under examples/
    overrides: tuple[str, ...] = ()
    kernels: str = "ours"  # train.kernels
    speed: bool = False  # the shaped model, SPEED_STEPS steps, no learning check
    learnt: str = "reward"  # the metric that shows learning: it rises (or falls, with lower)
    lower: bool = False


RUNS = {
    "lora": Run("tiny-grpo.yaml"),
    "qlora": Run("tiny-grpo.yaml", ("--model.qlora=true",)),
    "moe": Run("tiny-moe-grpo.yaml"),
    "qlora-moe": Run("tiny-moe-grpo.yaml", ("--model.qlora=true",)),  # examples/qwen3-30b-a3b-qlora.yaml's path
    "ebft": Run("tiny-ebft.yaml", learnt="ebft/cfm_loss", lower=True),  # feature matching, as its e2e test
    "full": Run("tiny-grpo.yaml", ("--model.adapter=none", "--train.lr=1.0e-3")),  # bf16 on CPU: 0.08 -> 1.00
    # zero_advantage keep: every step trains all its completions (a random model's groups of equal rewards
    # would otherwise leave steps with nothing to update, and medians of nothing)
    "speed-ours": Run("tiny-grpo.yaml", ("--algo.zero_advantage=keep", SPEED_TOKENS), speed=True),
    "speed-torch": Run("tiny-grpo.yaml", ("--algo.zero_advantage=keep", SPEED_TOKENS), kernels="torch", speed=True),
    # float16 with its loss scale (driver/update/loss_scale.py) through our kernels' fp16 paths; last, so a short
    # lease spends its time on the bf16 runs first
    "lora-fp16": Run("tiny-grpo.yaml", ("--model.dtype=float16",)),
}


def command(name: str, run: Run, device: str, steps: int, model: str | None) -> list[str]:
    return [sys.executable, "-m", "driver.train", str(EXAMPLES / run.config), f"--model.device={device}",
            "--model.dtype=bfloat16", "--rollout.backend=transformers", f"--train.kernels={run.kernels}",
            f"--train.steps={steps}", f"--logging.output_dir={OUTPUT_DIR / name}", *QUIET,
            *([f"--model.path={model}"] if model else []), *run.overrides]


def medians(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return statistics.median(values) if values else math.nan


def check_run(rows: list[dict], steps: int, run: Run) -> tuple[list[str], dict[str, float]]:
    """(what is wrong with the run's metrics, its table row) from metrics.jsonl's rows."""
    problems = []
    if len(rows) != steps:
        problems.append(f"{len(rows)} metrics lines for {steps} steps")
    for row in rows:
        bad = [key for key in ("loss", "grad_norm") if not math.isfinite(row.get(key, math.nan))]
        if bad:
            problems.append(f"step {row.get('step')}: {', '.join(bad)} not finite ({[row.get(k) for k in bad]})")
            break
    values = [row[run.learnt] for row in rows if run.learnt in row]
    first = statistics.mean(values[:LEARNT_OVER]) if values else math.nan
    last = statistics.mean(values[-LEARNT_OVER:]) if values else math.nan
    if not run.speed and len(values) >= 2 * LEARNT_OVER and not (last < first if run.lower else last > first):
        problems.append(f"did not learn: mean {run.learnt} {first:.3f} over the first {LEARNT_OVER} steps, "
                        f"{last:.3f} over the last")
    timed = rows[WARM_STEPS:] if run.speed else rows
    row = {key: medians(timed, key) for key in ("time/step", "time/generation", "time/update")}
    row |= {"memory/update_peak_gib": medians(rows, "memory/update_peak_gib"), "learnt": run.learnt, "first": first,
            "last": last, "first_updates": sum(step.get("time/update", math.nan) for step in rows[:WARM_STEPS])}
    return problems, row


def table(results: dict[str, tuple[float, dict[str, float]]]) -> str:
    lines = [f"| run | wall s | step ms | generation ms | update ms | first {WARM_STEPS} updates s | update peak GiB | "
             f"first -> last {LEARNT_OVER} steps |", "|---|---|---|---|---|---|---|---|"]
    for name, (wall, row) in results.items():
        ms = [f"{1e3 * row[key]:.1f}" for key in ("time/step", "time/generation", "time/update")]
        lines.append(f"| {name} | {wall:.0f} | {' | '.join(ms)} | {row['first_updates']:.1f} | "
                     f"{row['memory/update_peak_gib']:.2f} | "
                     f"{row['learnt']} {row['first']:.3f} -> {row['last']:.3f} |")
    ours, torch_ = results.get("speed-ours"), results.get("speed-torch")
    if ours and torch_:
        lines.append(f"\nupdate, {SPEED_SHAPE} shapes x {SPEED_LAYERS} layers: torch / ours = "
                     f"{torch_[1]['time/update'] / ours[1]['time/update']:.2f}x")
    return "\n".join(lines)


def body(args, started: float) -> int:
    versions = stage.check_cuda_torch(args.dry_run) if args.device.startswith("cuda") else "on the CPU"
    print(f"driver runs ({versions}): {', '.join(args.runs)}")
    unknown = [name for name in args.runs if name not in RUNS]
    if unknown:
        raise stage.StageError(f"unknown runs {', '.join(unknown)} (known: {', '.join(RUNS)})")
    model = None
    if any(RUNS[name].speed for name in args.runs):
        import driver.data.tiny_model  # noqa: F401 - what shaped_model imports: checked by a dry run too
        from benchmarks.trl_step import shaped_model  # builds it once into the pykernels cache

        model = "<shaped model>" if args.dry_run else shaped_model(SPEED_SHAPE, SPEED_LAYERS)
    results, failures = {}, []
    for name in args.runs:
        run = RUNS[name]
        steps = SPEED_STEPS if run.speed else args.steps
        begun = time.monotonic()
        try:
            result = stage.run(command(name, run, args.device, steps, model if run.speed else None),
                               dry_run=args.dry_run, timeout_s=stage.remaining(started))
        except stage.StageError as error:  # out of time: the runs done so far still get their table
            failures.append(f"{name}: {error}")
            break
        if result is None:
            continue
        wall = time.monotonic() - begun
        metrics = OUTPUT_DIR / name / "metrics.jsonl"
        if result.returncode != 0 or not metrics.is_file():
            failures.append(f"{name}: exit {result.returncode} (its log: {OUTPUT_DIR / name / 'run.log'})")
            continue
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        problems, row = check_run(rows, steps, run)
        failures += [f"{name}: {problem}" for problem in problems]
        results[name] = (wall, row)
    if results:
        print(table(results))
    if failures:
        raise stage.StageError("; ".join(failures))
    return 0


def options(parser) -> None:
    parser.add_argument("--runs", type=lambda text: [name for name in text.split(",") if name],
                        default=list(RUNS), help=f"comma-separated, of: {', '.join(RUNS)} (default: all)")
    parser.add_argument("--steps", type=int, default=40, help="steps of each tiny run (the speed runs make "
                        f"{SPEED_STEPS})")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the stage here")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-driver-runs", body, args))
