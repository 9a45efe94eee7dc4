"""logging.report_to's trackers with the real packages, offline: wandb in WANDB_MODE=offline (its run
files read back), MLflow on a file store under output_dir (read back with its client); the completions
tables in completions.jsonl and the trackers; TRL's cumulative num_tokens; a resumed run continuing the
same tracker runs and dropping the completions of the steps it redoes."""

import json
import warnings

import pytest

from driver.cli import load_config
from driver.metrics.logger import TOKENS_IN_STEP, MetricsLogger
from driver.metrics.trackers import TRACKER_IDS, open_trackers
from tests.wandb_records import history as wandb_history
from tests.wandb_records import records as wandb_records

ROWS = [{"prompt": "Write digits:", "completion": " 12", "reward": 1.0, "advantage": 0.7, "rewards/digits": 1.0},
        {"prompt": "Write digits:", "completion": " ab", "reward": 0.0, "advantage": -0.7, "rewards/digits": None}]


def make_logger(output_dir, start_step=0):
    trackers = open_trackers(["tensorboard", "wandb", "mlflow"], output_dir, "unit", "run-a", {"train": {"lr": 1e-3}},
                             resume=start_step > 0)
    return MetricsLogger(output_dir, total_steps=4, start_step=start_step, tensorboard=False, progress=False,
                         trackers=trackers)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "run"


def mlflow_history(output_dir, key):
    from mlflow.tracking import MlflowClient

    run_id = json.loads((output_dir / TRACKER_IDS).read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(output_dir / "mlruns").resolve().as_uri())
    return client, run_id, [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def finished_wandb_history(output_dir, run_id):
    """(steps, what else the file holds) of the offline wandb run run_id, read after wandb.teardown(): run.finish()
    only tells wandb-core to close the run, and teardown waits for the core to exit, every run it holds closed (the
    driver's process gets the same from wandb's atexit hook). Once on a loaded CI machine the file read right after
    finish() held no history records (not reproduced since, under load or alone); the record types and the core's
    warnings and errors (an ignored step is one) go into the assertion message should it happen again."""
    import wandb

    wandb.teardown()
    [run_file] = list(output_dir.glob(f"wandb/offline-run-*/run-{run_id}.wandb"))
    internal_log = run_file.parent / "logs" / "debug-internal.log"
    context = {"records": [record.WhichOneof("record_type") for record in wandb_records(run_file)],
               "bytes": run_file.stat().st_size,
               "core warnings": [line for line in internal_log.read_text().splitlines() if '"level":"INFO"' not in line]
               if internal_log.exists() else None}
    return wandb_history(run_file), context


def test_metrics_and_completions_reach_every_tracker_and_resume_continues_them(offline):
    output_dir = offline
    output_dir.mkdir()
    with make_logger(output_dir) as logger:
        logger.log(1, {"reward": 0.25, TOKENS_IN_STEP: 100, "kl": float("nan")})
        logger.log(2, {"reward": 0.5, TOKENS_IN_STEP: 120})
        logger.log_completions(2, ROWS)
        logger.log_eval(2, {"eval/reward": 0.875}, ROWS[:1])  # an evaluation after step 2: its own table
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row.get("num_tokens") for row in rows] == [100, 220, None] and TOKENS_IN_STEP not in rows[0]
    lines = [json.loads(line) for line in (output_dir / "completions.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, **row} for row in ROWS]

    client, run_id, history = mlflow_history(output_dir, "reward")
    assert history == [(1, 0.25), (2, 0.5)]
    assert mlflow_history(output_dir, "kl")[2] == []  # NaN is not a point
    artifacts = [a.path for a in client.list_artifacts(run_id, "completions")]
    assert artifacts == ["completions/step_000002.json"]
    assert [a.path for a in client.list_artifacts(run_id, "eval_completions")] == ["eval_completions/step_000002.json"]
    assert mlflow_history(output_dir, "eval/reward")[2] == [(2, 0.875)]
    wandb_id = json.loads((output_dir / TRACKER_IDS).read_text())["wandb"]
    steps, context = finished_wandb_history(output_dir, wandb_id)
    assert [(row["_step"], row.get("reward"), row.get("num_tokens")) for row in steps if "reward" in row] == \
        [(1, 0.25, 100), (2, 0.5, 220)], context
    assert "kl" not in steps[0]  # NaN is not a point
    assert steps[1]["completions/_type"] == "table-file" and steps[1]["completions/nrows"] == 2  # nested keys
    assert steps[1]["completions/ncols"] == 6  # step, prompt, completion, reward, advantage, rewards/digits
    assert steps[1]["eval/reward"] == 0.875 and steps[1]["eval_completions/nrows"] == 1  # step 2's row too

    with make_logger(output_dir, start_step=1) as logger:  # resumed from step 1: step 2 is redone
        assert not (output_dir / "completions.jsonl").read_text()
        logger.log(2, {"reward": 0.75, TOKENS_IN_STEP: 50})
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["num_tokens"] for row in rows] == [100, 150]
    ids = json.loads((output_dir / TRACKER_IDS).read_text())
    assert ids["wandb"] == wandb_id and ids["mlflow"] == run_id
    assert mlflow_history(output_dir, "reward")[2][-1] == (2, 0.75)


def test_the_old_tensorboard_key_maps_to_report_to():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_config(None, {"logging.tensorboard": "false"}).logging.report_to == []
    assert any("logging.report_to" in str(w.message) for w in caught)
    assert load_config(None, {}).logging.tensorboard
    assert load_config(None, {"logging.report_to": "[wandb, wandb]"}).logging.report_to == ["wandb"]


@pytest.mark.parametrize(("report_to", "message"), [
    (None, "logging.report_to has tensorboard (its default), which is not installed: pip install tensorboard"),
    (["wandb"], "not installed: wandb (pip install wandb)"),
])
def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch, report_to, message):
    """Before: the default TensorBoard missing was an ImportError traceback once the model had loaded."""
    import driver.config

    real = driver.config.find_spec
    monkeypatch.setattr(driver.config, "find_spec",
                        lambda name: None if name in ("tensorboard", "wandb") else real(name))
    logging = {} if report_to is None else {"report_to": report_to}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        driver.config.Config.model_validate({"logging": logging})
    driver.config.Config.model_validate({"logging": {"report_to": []}})  # metrics.jsonl alone needs nothing
