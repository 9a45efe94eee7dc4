"""Per-step metrics: one JSON line per step, TensorBoard scalars, the trackers (wandb, MLflow), the
completions tables (completions.jsonl) and a rich progress bar. An evaluation (the eval section) adds a
line of its own at its step (readers merge a step's lines) and its completions to eval_completions.jsonl.

`metrics.jsonl` is the record of the run: every line is flushed as soon as it is written, so a
crash loses nothing, and every line is valid JSON (NaN and inf become null, tensors and numpy
scalars become Python floats). A run resumed from the checkpoint at step k first drops the lines
of steps after k, so the file never holds two histories of the same step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # the completions tables: one line per completion, with its step
EVAL_COMPLETIONS_FILE = "eval_completions.jsonl"  # the same for the evaluations' completions
EVAL_TABLE = "eval_completions"  # the trackers' table of an evaluation's completions
TOKENS_IN_STEP = "num_input_tokens"  # a batch's prompt + completion tokens; logged cumulated as num_tokens (TRL's)
TENSORBOARD_DIR = "tensorboard"
# Fields the logger writes itself; a metric with one of these names would silently overwrite them.
RESERVED_KEYS = ("step", "time", "step_time")


def to_float(key: str, value: Any) -> float | None:
    """A metric value as a Python float (None stays None); tensors and numpy scalars via .item()."""
    if value is None:
        return None
    if hasattr(value, "item"):  # torch.Tensor, numpy scalar or 0-d array
        try:
            value = value.item()
        except (ValueError, RuntimeError) as error:
            raise TypeError(f"metric '{key}' must be a scalar, got {type(value).__name__} "
                            f"with shape {tuple(getattr(value, 'shape', ()))}") from error
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metric '{key}' must be a number or None, got {value!r}") from error


def _json_default(value):
    raise TypeError(f"completions table value {value!r} ({type(value).__name__}) is not JSON")


def json_safe(value: float | None) -> float | None:
    # JSON has no NaN or Infinity; Python would write them as bare tokens that other readers reject.
    return value if value is not None and math.isfinite(value) else None


def keep_steps_up_to(path: Path, last_step: int) -> None:
    """Rewrite `path` without the lines of steps after `last_step` (and without a torn last line)."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash we are resuming from
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            kept.append(line + "\n")
    # Write aside and rename, so a crash during the rewrite cannot lose the kept history.
    staging = path.with_suffix(path.suffix + ".tmp")
    staging.write_text("".join(kept))
    os.replace(staging, path)


def step_summary(metrics: Mapping[str, float | None], step_time: float) -> str:
    """The text beside the progress bar, e.g. 'reward 0.412  kl 0.003  2.1 s/step'."""
    parts = [f"{key} {compact(metrics[key])}" for key in ("reward", "kl") if metrics.get(key) is not None]
    parts.append(f"{step_time:.1f} s/step" if step_time >= 1 else f"{step_time:.2f} s/step")
    return "  ".join(parts)


def compact(value: float) -> str:
    # Three decimals read well for rewards; a KL of 2e-5 would show as 0.000, so small values go to e-notation.
    return f"{value:.3f}" if value == 0 or abs(value) >= 1e-3 or not math.isfinite(value) else f"{value:.1e}"


class MetricsLogger:
    """Called once per optimizer step by the training loop; see the module docstring for the files.

    `print` goes through the same rich Console as the progress bar, so its lines appear above the
    bar instead of tearing it. `console` is for tests and embedding; the default writes to stdout.
    """

    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, console: Console | None = None,
                 trackers: list | None = None):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.completions_path = self.output_dir / COMPLETIONS_FILE
        self.eval_completions_path = self.output_dir / EVAL_COMPLETIONS_FILE
        self.console = console if console is not None else Console()
        self.trackers = list(trackers or [])  # driver/metrics/trackers.py: wandb, mlflow
        self._metrics_file = self._open_metrics_file(start_step)
        self._tokens_seen = self._last_logged("num_tokens") if start_step > 0 else 0.0
        for path in (self.completions_path, self.eval_completions_path):
            if start_step > 0 and path.exists():
                keep_steps_up_to(path, start_step)
            elif path.exists():
                path.unlink()
        self._writer = self._open_tensorboard(start_step) if tensorboard else None
        self._progress, self._task = self._start_progress(total_steps, start_step) if progress else (None, None)
        self._last_log_time = time.monotonic()
        self._closed = False

    def _open_metrics_file(self, start_step: int) -> IO[str]:
        if start_step > 0 and self.metrics_path.exists():
            keep_steps_up_to(self.metrics_path, start_step)
            return self.metrics_path.open("a")
        # A fresh run (start_step 0) keeps no steps of an earlier run in the same directory.
        return self.metrics_path.open("w")

    def _last_logged(self, key: str) -> float:
        """The value of `key` in the last step kept in metrics.jsonl (0 when none has it)."""
        last = 0.0
        for line in self.metrics_path.read_text().splitlines():
            value = json.loads(line).get(key)
            last = value if value is not None else last
        return float(last)

    def _open_tensorboard(self, start_step: int):
        # Imported here: loading TensorBoard takes about a second that runs without it should not pay.
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the crashed run's events after the checkpoint we resume from.
        return SummaryWriter(str(self.output_dir / TENSORBOARD_DIR),
                             purge_step=start_step + 1 if start_step > 0 else None, flush_secs=30)

    def _start_progress(self, total_steps: int, start_step: int):
        # rich moves what Python code writes to sys.stdout / sys.stderr above the bar, which is right
        # where those print on this terminal (logging.quiet off). With logging.quiet they are run.log:
        # kept there (a reward function's prints, Python's warnings), not brought back to the terminal.
        printing_here = sys.stdout is self.console.file
        progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[summary]}"),
                            console=self.console, redirect_stdout=printing_here, redirect_stderr=printing_here)
        task = progress.add_task("train", total=total_steps, completed=start_step, summary="")
        progress.start()
        return progress, task

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        reserved = [key for key in RESERVED_KEYS if key in metrics]
        if reserved:
            raise ValueError(f"metric names {reserved} are reserved for the logger's own fields")
        now = time.monotonic()
        step_time, self._last_log_time = now - self._last_log_time, now
        values = {key: to_float(key, value) for key, value in metrics.items()}
        if TOKENS_IN_STEP in values:  # TRL's num_tokens: every prompt and completion token generated so far
            self._tokens_seen += values.pop(TOKENS_IN_STEP) or 0.0
            values["num_tokens"] = self._tokens_seen
        self._write(step, {**values, "step_time": step_time})
        if self._progress is not None:
            self._progress.update(self._task, completed=step, summary=step_summary(values, step_time))

    def log_eval(self, step: int, metrics: Mapping[str, Any], rows: list[dict]) -> None:
        """An evaluation after `step` steps: a line of its own in metrics.jsonl, the trackers and TensorBoard,
        its completions in eval_completions.jsonl and the trackers' eval_completions tables. Its time is not
        the next step's step_time."""
        self._write(step, {key: to_float(key, value) for key, value in metrics.items()})
        self._log_table(self.eval_completions_path, step, rows, EVAL_TABLE)
        self._last_log_time = time.monotonic()

    def _write(self, step: int, values: dict[str, float | None]) -> None:
        row = {"step": step, **{key: json_safe(value) for key, value in values.items()}, "time": time.time()}
        self._metrics_file.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_file.flush()
        if self._writer is not None:
            for tag, value in values.items():
                if value is not None:  # NaN and inf are kept: TensorBoard shows them, and they matter
                    self._writer.add_scalar(tag, value, step)
        for tracker in self.trackers:
            tracker.log(step, values)

    def log_completions(self, step: int, rows: list[dict]) -> None:
        """One step's completions table (prompt, completion, reward, advantage, per-function rewards):
        a line per completion in completions.jsonl, and a table in each tracker."""
        self._log_table(self.completions_path, step, rows, "completions")

    def _log_table(self, path: Path, step: int, rows: list[dict], name: str) -> None:
        """A completions table: a line per row in `path`, and table `name` in each tracker."""
        if not rows:
            return
        with path.open("a") as lines:
            for row in rows:
                lines.write(json.dumps({"step": step, **row}, allow_nan=False, default=_json_default) + "\n")
        for tracker in self.trackers:
            tracker.log_table(step, rows, name)

    def print(self, *objects) -> None:
        self.console.print(*objects)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._writer is not None:
            self._writer.close()
        for tracker in self.trackers:
            tracker.close()
        self._metrics_file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *_exc_info) -> None:
        self.close()
