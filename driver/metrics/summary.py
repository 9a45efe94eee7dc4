"""What a finished (or interrupted) run prints last: how it went, where its outputs are, and the
command that resumes or extends it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from driver.metrics.console import LOG_FILE
from driver.metrics.logger import EVAL_COMPLETIONS_FILE, METRICS_FILE, TENSORBOARD_DIR

REWARD_KEYS = ("reward", "ebft/reward")  # GRPO's, then EBFT's
EVAL_PREFIX = "eval/"  # the one evaluation set's metrics; eval_<set>/ for each of eval.sets
WINDOW = 10  # steps averaged at each end of the run


def read_rows(metrics_path: Path) -> list[dict]:
    if not metrics_path.exists():
        return []
    rows = []
    for line in metrics_path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
    return rows


def reward_trend(rows: list[dict]) -> str | None:
    key = next((key for key in REWARD_KEYS if any(row.get(key) is not None for row in rows)), None)
    if key is None:
        return None
    values = [row[key] for row in rows if row.get(key) is not None]
    window = min(WINDOW, max(1, len(values) // 2))
    first, last = sum(values[:window]) / window, sum(values[-window:]) / window
    return f"{key}: first {window} steps {first:.3f} -> last {window} steps {last:.3f}"


def is_eval_key(key: str, metric: str) -> bool:
    """An evaluation set's `metric` (eval/<metric>, or eval_<set>/<metric> with eval.sets)."""
    return key == EVAL_PREFIX + metric or (key.startswith("eval_") and key.endswith("/" + metric)
                                           and key.count("/") == metric.count("/") + 1)


def eval_trends(rows: list[dict]) -> list[str]:
    """Each evaluation set's first and last reward (the same prompts and seeds: comparable as they are)."""
    keys = dict.fromkeys(key for row in rows for key in row if is_eval_key(key, "reward"))
    return [trend for key in keys if (trend := eval_trend(rows, key)) is not None]


def eval_trend(rows: list[dict], key: str = EVAL_PREFIX + "reward") -> str | None:
    evaluations = [row for row in rows if row.get(key) is not None]
    if not evaluations:
        return None
    first, last = evaluations[0], evaluations[-1]
    trend = f"{first[key]:.3f} at step {first['step']}"
    if len(evaluations) > 1:
        trend += f" -> {last[key]:.3f} at step {last['step']}"
    prompts = key.removesuffix("reward") + "prompts"
    return f"{key}: {trend} ({int(last.get(prompts) or 0)} prompts)"


def evaluation_summary(output_dir: Path, *, wall_seconds: float, quiet: bool) -> str:
    """What an evaluation-only run (eval.only) prints last: its result and where the completions are."""
    rows = [row for row in read_rows(output_dir / METRICS_FILE)
            if any(is_eval_key(key, "prompts") and value is not None for key, value in row.items())]
    minutes, seconds = divmod(int(round(wall_seconds)), 60)
    lines = [f"evaluated in {minutes}m{seconds:02d}s (eval.only: nothing trained)"]
    if rows:
        result = rows[-1]
        rewards = [f"{key} {value:.3f}" for key, value in result.items()
                   if key.startswith("eval") and "/rewards/" in key and key.endswith("/mean") and value is not None]
        trends = eval_trends(rows) or ["eval/reward: n/a (no group could be scored)"]
        lines += [f"  {trend}" for trend in trends[:-1]]
        lines.append(f"  {trends[-1]}" + (f"; {', '.join(rewards)}" if len(rewards) > len(trends) else ""))
    outputs = [("metrics", output_dir / METRICS_FILE, "the eval/ metrics"),
               ("evaluated", output_dir / EVAL_COMPLETIONS_FILE, "each evaluated completion, its rewards")]
    return "\n".join(lines + listed(outputs, output_dir, quiet))


def listed(outputs: list[tuple[str, object, str]], output_dir: Path, quiet: bool) -> list[str]:
    """The summary's outputs, a line each (name, where, what it is), run.log last when the libraries wrote there."""
    if quiet:
        outputs = [*outputs, ("log", output_dir / LOG_FILE, "vLLM's and the libraries' output")]
    return [f"  {name:<11} {path}  ({what})" for name, path, what in outputs]


def interpreter() -> str:
    """How the user runs Python here: `.venv/bin/python` inside the project, else `python`."""
    relative = os.path.relpath(sys.executable)
    return relative if not relative.startswith("..") else "python"


def run_summary(output_dir: Path, *, steps_done: int, steps_planned: int, wall_seconds: float,
                quiet: bool, plots: bool, tensorboard: bool, best: tuple[Path, dict] | None = None,
                epochs: float | None = None, hub: str | None = None) -> str:
    """best: eval.save_best's directory and what its best.json says (step, metric); epochs: train.epochs, which
    decided the steps (a longer run then doubles it); hub: the repository the run uploaded to."""
    rows = read_rows(output_dir / METRICS_FILE)
    minutes, seconds = divmod(int(round(wall_seconds)), 60)
    lines = [f"{'finished' if steps_done >= steps_planned else 'stopped at'} step {steps_done} of {steps_planned} "
             f"in {minutes}m{seconds:02d}s"]
    for trend in (reward_trend(rows), *eval_trends(rows)):
        if trend is not None:
            lines.append(f"  {trend}")
    outputs = [("adapter", output_dir / "adapter", "PEFT format: PeftModel.from_pretrained, vLLM LoRARequest")
               if not (output_dir / "model").is_dir() else
               ("model", output_dir / "model", "full fine-tuning: AutoModelForCausalLM.from_pretrained, vllm serve"),
               ("metrics", output_dir / METRICS_FILE, "one JSON line per step")]
    if best is not None:
        directory, record = best
        metric, value = next((key, value) for key, value in record.items() if key != "step")
        outputs.append(("best", directory, f"the best evaluation's weights: step {record['step']}, {metric} "
                                           f"{value:.3f}"))
    if hub is not None:
        outputs.append(("hub", hub, "the uploaded adapter: PeftModel.from_pretrained with the repository's id"))
    if (output_dir / EVAL_COMPLETIONS_FILE).exists():
        outputs.append(("evaluated", output_dir / EVAL_COMPLETIONS_FILE, "each evaluated completion, its rewards"))
    if plots:
        outputs.append(("plots", output_dir / "plots", "PNG curves"))
    if tensorboard:
        events = output_dir / TENSORBOARD_DIR
        outputs.append(("tensorboard", events, f"tensorboard --logdir {events}"))
    lines += listed(outputs, output_dir, quiet)
    command = f"{interpreter()} -m driver.train {output_dir / 'config.yaml'} --checkpoint.resume=latest"
    if steps_done < steps_planned:
        lines.append(f"  resume:   {command}")
    else:
        longer = f"--train.epochs={2 * epochs:g}" if epochs is not None else f"--train.steps={2 * steps_planned}"
        lines.append(f"  continue: {command} {longer}")
    return "\n".join(lines)
