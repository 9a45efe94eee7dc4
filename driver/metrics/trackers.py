"""Experiment trackers beside metrics.jsonl (logging.report_to): Weights & Biases and MLflow, each an
optional package imported only when named. Both get every step's metrics and the completions tables;
TensorBoard stays in MetricsLogger (driver/metrics/logger.py), which also writes completions.jsonl.

A resumed run continues the same tracker run: wandb's run id and MLflow's run id are kept in
output_dir (TRACKER_IDS), so the curves of one run stay one curve.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Protocol

TRACKER_IDS = "tracker_runs.json"
TABLE_COLUMNS = ("prompt", "completion", "reward", "advantage")


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float | None]) -> None: ...

    def log_table(self, step: int, rows: list[dict], name: str = "completions") -> None:
        """A completions table: the step's ("completions") or an evaluation's ("eval_completions")."""

    def close(self) -> None: ...


def table_columns(rows: list[dict]) -> list[str]:
    """The table's columns in a fixed order: TABLE_COLUMNS first, then the rest (per-function rewards)."""
    extra = sorted({key for row in rows for key in row} - set(TABLE_COLUMNS) - {"step"})
    return ["step", *TABLE_COLUMNS, *extra]


def _finite(values: dict[str, float | None]) -> dict[str, float]:
    return {key: value for key, value in values.items() if value is not None and math.isfinite(value)}


class _RunIds:
    """Tracker run ids of this output_dir, so that a resumed run logs into the run it continues."""

    def __init__(self, output_dir: Path) -> None:
        self.path = output_dir / TRACKER_IDS
        self.ids = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, tracker: str) -> str | None:
        return self.ids.get(tracker)

    def set(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        self.path.write_text(json.dumps(self.ids))


class WandbTracker:
    def __init__(self, output_dir: Path, project: str, run_name: str, config: dict, resume: bool) -> None:
        import wandb

        ids = _RunIds(output_dir)
        run_id = ids.get("wandb") if resume else None
        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(output_dir), config=config,
                              id=run_id, resume="allow" if run_id else None)
        ids.set("wandb", self.run.id)

    def log(self, step: int, values: dict[str, float | None]) -> None:
        self.run.log(_finite(values), step=step)

    def log_table(self, step: int, rows: list[dict], name: str = "completions") -> None:
        columns = table_columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(column) for column in columns] for row in rows])
        self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, output_dir: Path, project: str, run_name: str, config: dict, resume: bool) -> None:
        import mlflow

        self.mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # A file store beside the run's other outputs: nothing to set up. MLflow 3 keeps it working but
            # refuses it unless told (its database store needs sqlalchemy, which mlflow-skinny lacks).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        ids = _RunIds(output_dir)
        run_id = ids.get("mlflow") if resume else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        if run_id is None:
            mlflow.log_dict(config, "config.json")
        ids.set("mlflow", self.run.info.run_id)

    def log(self, step: int, values: dict[str, float | None]) -> None:
        self.mlflow.log_metrics(_finite(values), step=step)

    def log_table(self, step: int, rows: list[dict], name: str = "completions") -> None:
        columns = table_columns(rows)
        self.mlflow.log_table({column: [row.get(column) for row in rows] for column in columns},
                              artifact_file=f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(report_to: list[str], output_dir: Path, project: str, run_name: str | None, config: dict,
                  resume: bool) -> list[Tracker]:
    """The trackers report_to names (tensorboard is MetricsLogger's own); a tracker that fails to start
    closes the ones started before it."""
    trackers: list[Tracker] = []
    try:
        for name in report_to:
            if name in TRACKERS:
                trackers.append(TRACKERS[name](output_dir, project, run_name or output_dir.resolve().name, config,
                                               resume))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
