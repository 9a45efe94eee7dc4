"""PNG plots of a run's metrics.jsonl: one file per curve and an overview of the main ones.

Figures are built with matplotlib's object API on the Agg canvas, never through pyplot, so
plotting works on headless machines and leaves no global backend state or open figures behind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from driver.metrics.summary import is_eval_key

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAIN_CURVES = ("reward", "eval/reward", "reward_std", "kl", "entropy", "completions/mean_length",
               "clip_ratio/region_mean", "sampling/importance_sampling_ratio/mean", "loss",
               "ebft/cfm_loss", "ebft/alignment", "ebft/diversity", "ebft/reward")  # EBFT runs log no "reward"
PLOTS_DIR = "plots"
# Weight of the previous average in the exponential moving average drawn over the raw values; 0.9
# averages over roughly the last ten steps, TensorBoard's default look for noisy RL curves.
EMA_SMOOTHING = 0.9
# Keys whose "best" value has a clear direction; other curves report their range instead.
HIGHER_IS_BETTER = ("reward", "rewards/", "eval/reward", "eval_", "ebft/alignment", "ebft/reward")  # eval_<set>/reward
LOWER_IS_BETTER = ("loss", "ebft/cfm_loss")
EVALUATED = ("eval/", "eval_")  # the eval section's metrics: the one set's, eval_<set>/ for each of eval.sets


def read_metrics(metrics_path: Path) -> list[dict]:
    """The rows of metrics.jsonl by step; a step's lines merged (an evaluation writes its own; a key logged twice
    keeps its last value), a torn line skipped."""
    metrics_path = Path(metrics_path)
    if not metrics_path.exists():
        raise FileNotFoundError(f"metrics file not found: {metrics_path}")
    rows_by_step: dict[int, dict] = {}
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # empty, or cut short by a crash mid-write
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows_by_step.setdefault(row["step"], {}).update(row)
    return [rows_by_step[step] for step in sorted(rows_by_step)]


def curve(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one key; null, inf and non-numbers become NaN, which the plots leave out."""
    steps, values = [], []
    for row in rows:
        if key in row:
            value = row[key]
            finite = isinstance(value, (int, float)) and math.isfinite(value)
            steps.append(row["step"])
            values.append(float(value) if finite else math.nan)
    return steps, values


def exponential_moving_average(values: list[float], smoothing: float = EMA_SMOOTHING) -> list[float]:
    """Debiased EMA (as in Adam and TensorBoard) so the first points are not pulled towards zero.

    NaN points stay NaN in the output and do not enter the average.
    """
    average, weight, smoothed = 0.0, 0.0, []
    for value in values:
        if math.isnan(value):
            smoothed.append(math.nan)
            continue
        average = smoothing * average + (1 - smoothing) * value
        weight = smoothing * weight + (1 - smoothing)
        smoothed.append(average / weight)
    return smoothed


def title(key: str, values: list[float]) -> str:
    finite = [value for value in values if not math.isnan(value)]
    last = f"{key}   last {finite[-1]:.4g}"
    if key.startswith(HIGHER_IS_BETTER):
        return f"{last}   best {max(finite):.4g}"
    if key.startswith(LOWER_IS_BETTER):
        return f"{last}   best {min(finite):.4g}"
    return f"{last}   range [{min(finite):.4g}, {max(finite):.4g}]"


def draw_curve(axes, key: str, steps: list[float], values: list[float], *, title_size: float) -> None:
    # Lines join the finite points across gaps: a metric logged every other step would otherwise
    # be broken into isolated points that draw nothing.
    finite = [index for index, value in enumerate(values) if not math.isnan(value)]
    finite_steps = [steps[index] for index in finite]
    if key.startswith(EVALUATED):  # a few points, each over the same prompts: shown as they are, not averaged
        axes.plot(finite_steps, [values[index] for index in finite], linewidth=1.8, marker="o", color="tab:green",
                  label="evaluation")
    else:
        smoothed = exponential_moving_average(values)
        axes.plot(finite_steps, [values[index] for index in finite], linewidth=0.8, alpha=0.35, color="tab:blue",
                  label="raw")
        axes.plot(finite_steps, [smoothed[index] for index in finite], linewidth=1.8, color="tab:blue",
                  label=f"EMA ({EMA_SMOOTHING})")
    axes.set_title(title(key, values), fontsize=title_size)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)


def save(figure: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # attaches the Agg canvas: PNG output without any GUI backend
    figure.savefig(path, dpi=100)
    return path


def plot_metrics(metrics_path: Path, output_dir: Path, keys: Sequence[str] = MAIN_CURVES) -> list[Path]:
    """Write output_dir/plots/<key with '/' -> '_'>.png for every key with a finite value, then overview.png.

    Returns the written paths, overview.png last; [] when the file has no rows or none of the keys.
    """
    rows = read_metrics(metrics_path)
    if "eval/reward" in keys:  # eval.sets: each set's reward curve beside it
        found = dict.fromkeys(key for row in rows for key in row if is_eval_key(key, "reward") and key not in keys)
        at = keys.index("eval/reward") + 1
        keys = (*keys[:at], *found, *keys[at:])
    curves = {key: curve(rows, key) for key in keys}
    curves = {key: (steps, values) for key, (steps, values) in curves.items()
              if any(not math.isnan(value) for value in values)}
    if not curves:
        return []
    # Imported here: matplotlib takes ~0.4 s to import, paid by every run and CLI call that imports the
    # driver, while only the end of a run with logging.plots draws.
    from matplotlib.figure import Figure

    plots_dir = Path(output_dir) / PLOTS_DIR
    plots_dir.mkdir(parents=True, exist_ok=True)

    written = []
    for key, (steps, values) in curves.items():
        figure = Figure(figsize=(7, 4), layout="constrained")
        axes = figure.add_subplot()
        draw_curve(axes, key, steps, values, title_size=10)
        axes.legend(fontsize=8)
        written.append(save(figure, plots_dir / f"{key.replace('/', '_')}.png"))

    columns = min(4, len(curves))
    rows_of_plots = math.ceil(len(curves) / columns)
    overview = Figure(figsize=(4.5 * columns, 3.2 * rows_of_plots), layout="constrained")
    for index, (key, (steps, values)) in enumerate(curves.items()):
        draw_curve(overview.add_subplot(rows_of_plots, columns, index + 1), key, steps, values, title_size=8)
    written.append(save(overview, plots_dir / "overview.png"))
    return written
