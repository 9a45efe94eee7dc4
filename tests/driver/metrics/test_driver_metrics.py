"""driver.metrics.logger: the jsonl record, resume truncation, TensorBoard scalars and console output."""

import io
import json
import math
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from driver.metrics.logger import MetricsLogger, step_summary

TAGS = ("reward", "kl", "rewards/digit_fraction/mean", "sampling/importance_sampling_ratio/max")


def strict_json(line: str) -> dict:
    """json.loads that rejects the bare NaN / Infinity tokens Python's json would otherwise accept."""
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(line, parse_constant=reject)


def read_rows(output_dir) -> list[dict]:
    return [strict_json(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def quiet_logger(output_dir, **kwargs) -> MetricsLogger:
    return MetricsLogger(output_dir, total_steps=kwargs.pop("total_steps", 10), tensorboard=False,
                         progress=False, **kwargs)


def scalars(tensorboard_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tensorboard_dir))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_jsonl_lines_are_flushed_before_close(tmp_path):
    logger = quiet_logger(tmp_path)
    logger.log(1, {"reward": 0.25, "kl": 0.001})
    logger.log(2, {"reward": 0.5, "kl": 0.002})
    rows = read_rows(tmp_path)  # read while the logger is still open: a crash now must lose nothing
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1]["reward"] == 0.5 and rows[1]["kl"] == 0.002
    logger.close()


def test_time_and_step_time(tmp_path):
    before = time.time()
    with quiet_logger(tmp_path) as logger:
        time.sleep(0.02)
        logger.log(1, {"reward": 0.0})
        logger.log(2, {"reward": 0.0})
    rows = read_rows(tmp_path)
    assert all(row["step_time"] >= 0 for row in rows)
    assert rows[0]["step_time"] >= 0.015  # measured from construction for the first step
    assert all(before <= row["time"] <= time.time() for row in rows)


def test_non_finite_values_become_null(tmp_path):
    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"reward": math.nan, "kl": math.inf, "loss": -math.inf, "entropy": 1.5})
    row = read_rows(tmp_path)[0]  # strict_json raises on NaN / Infinity tokens
    assert row["reward"] is None and row["kl"] is None and row["loss"] is None
    assert row["entropy"] == 1.5


def test_tensor_and_numpy_values_become_floats(tmp_path):
    metrics = {"reward": torch.tensor(0.5), "kl": torch.tensor([0.25], dtype=torch.float64),
               "entropy": np.float32(0.125), "clip_ratio/region_mean": np.array(0.75), "count": torch.tensor(3)}
    with quiet_logger(tmp_path) as logger:
        logger.log(1, metrics)
    row = read_rows(tmp_path)[0]
    assert row["reward"] == 0.5 and row["kl"] == 0.25 and row["entropy"] == 0.125
    assert row["clip_ratio/region_mean"] == 0.75 and row["count"] == 3.0
    assert all(type(row[key]) is float for key in metrics)


def test_non_scalar_metric_names_the_key(tmp_path):
    with quiet_logger(tmp_path) as logger, pytest.raises(TypeError, match="'advantages'"):
        logger.log(1, {"advantages": torch.ones(3)})


def test_reserved_metric_names_are_rejected(tmp_path):
    with quiet_logger(tmp_path) as logger, pytest.raises(ValueError, match="step_time"):
        logger.log(1, {"step_time": 1.0})


def test_none_is_null_in_jsonl_and_skipped_in_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, total_steps=2, progress=False) as logger:
        logger.log(1, {"reward": None, "kl": 0.5})
        logger.log(2, {"reward": 0.75, "kl": None})
    rows = read_rows(tmp_path)
    assert rows[0]["reward"] is None and rows[1]["kl"] is None
    written = scalars(tmp_path / "tensorboard")
    assert written["reward"] == [(2, 0.75)]
    assert written["kl"] == [(1, 0.5)]


def test_tensorboard_keeps_slash_tags(tmp_path):
    with MetricsLogger(tmp_path, total_steps=3, progress=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {tag: step / 10 for tag in TAGS})
    written = scalars(tmp_path / "tensorboard")
    for tag in TAGS:
        assert [step for step, _ in written[tag]] == [1, 2, 3]
        assert written[tag][-1][1] == pytest.approx(0.3)
    assert "step_time" in written


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with quiet_logger(tmp_path) as crashed_run:
        for step in range(1, 6):
            crashed_run.log(step, {"reward": float(step)})
    with quiet_logger(tmp_path, start_step=3) as resumed_run:
        assert [row["step"] for row in read_rows(tmp_path)] == [1, 2, 3]  # truncated at construction
        resumed_run.log(4, {"reward": 40.0})
        resumed_run.log(5, {"reward": 50.0})
    rows = read_rows(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert [row["reward"] for row in rows] == [1.0, 2.0, 3.0, 40.0, 50.0]


def test_resume_skips_a_torn_last_line(tmp_path):
    with quiet_logger(tmp_path) as crashed_run:
        crashed_run.log(1, {"reward": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"step": 2, "rew')  # the crash hit mid-write
    with quiet_logger(tmp_path, start_step=2) as resumed_run:
        resumed_run.log(3, {"reward": 3.0})
    assert [row["step"] for row in read_rows(tmp_path)] == [1, 3]


def test_fresh_run_starts_a_new_file(tmp_path):
    with quiet_logger(tmp_path) as first_run:
        first_run.log(1, {"reward": 1.0})
    with quiet_logger(tmp_path) as second_run:
        second_run.log(1, {"reward": 2.0})
    assert [row["reward"] for row in read_rows(tmp_path)] == [2.0]


def test_resume_purges_tensorboard_steps_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, total_steps=5, progress=False) as crashed_run:
        for step in range(1, 6):
            crashed_run.log(step, {"reward": float(step)})
    time.sleep(1.1)  # event files are named by the second; the resumed run's must sort after
    with MetricsLogger(tmp_path, total_steps=5, start_step=3, progress=False) as resumed_run:
        resumed_run.log(4, {"reward": 40.0})
    assert scalars(tmp_path / "tensorboard")["reward"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_progress_disabled_prints_only_through_print(tmp_path, capsys):
    with quiet_logger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward": 0.5, "kl": 0.01})
        assert capsys.readouterr().out == ""
        logger.print("sample completion: 0123")
    assert capsys.readouterr().out == "sample completion: 0123\n"


def test_progress_bar_shows_step_reward_and_kl(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=True, width=160, record=True)
    with MetricsLogger(tmp_path, total_steps=10, tensorboard=False, console=console) as logger:
        logger.log(1, {"reward": 0.412, "kl": 0.003})
        logger.print("above the bar")
    text = console.export_text()
    assert "above the bar" in text
    assert "1/10" in text and "reward 0.412  kl 0.003" in text and "s/step" in text


def test_step_summary_format():
    assert step_summary({"reward": 0.412, "kl": 0.003}, 2.1) == "reward 0.412  kl 0.003  2.1 s/step"
    assert step_summary({"reward": 0.5, "kl": 2e-5}, 0.25) == "reward 0.500  kl 2.0e-05  0.25 s/step"
    assert step_summary({"reward": 0.5, "kl": None}, 1.0) == "reward 0.500  1.0 s/step"


# ---------------------------------------------------------------- combining micro-batches, iterations, ranks

def split_batch(lengths, seed):
    """(logps, old_logps, sampling_logps, advantages, mask) of len(lengths) sequences, T = max length."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).double()
    old = -3 * torch.rand(len(lengths), width, generator=generator, dtype=torch.float64)
    logps = old + 0.3 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    sampling = old - 0.4 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(len(lengths), generator=generator, dtype=torch.float64)
    return logps, old, sampling, advantages, mask


# Micro-batches of 3, 1, 4 and 2 sequences; the second holds one empty completion only
PART_SIZES = (3, 1, 4, 2)
PART_LENGTHS = (7, 2, 5, 0, 1, 6, 3, 4, 2, 7)


def part_metrics(rows: slice, lengths=PART_LENGTHS, seed=0):
    from driver.update.losses import StepNormalizers, importance_weights, policy_loss

    logps, old, sampling, advantages, mask = (tensor[rows] for tensor in split_batch(lengths, seed))
    normalizers = StepNormalizers(num_sequences=len(lengths), num_tokens=sum(lengths), num_micro_batches=1,
                                  max_completion_length=max(lengths))
    _, metrics = importance_weights(old, sampling, mask, level="token", mode="mask", cap=1.5)
    _, loss_metrics = policy_loss(logps, old, advantages, mask, loss_type="dapo", epsilon_low=0.1, epsilon_high=0.1,
                                  beta=0.0, normalizers=normalizers, ref_logps=old + 0.1)
    return metrics.update(loss_metrics)


def part_slices(sizes=PART_SIZES):
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    return [slice(start, start + size) for start, size in zip(starts, sizes)]


def assert_same_values(ours: dict, expected: dict):
    assert ours.keys() == expected.keys()
    wrong = {key: (ours[key], value) for key, value in expected.items() if ours[key] != pytest.approx(value, rel=1e-12)}
    assert not wrong, wrong


def test_combined_micro_batches_equal_the_whole_step():
    """Token means weighted by tokens, min of */min and *_min, max of */max and *_max: the combined
    micro-batches give the metrics of one pass over the whole step (a plain mean of micro-batch means
    would not: 3 + 1 + 4 + 2 sequences of 14, 0, 14 and 11 tokens)."""
    from driver.metrics.combine import combine_metrics

    whole = part_metrics(slice(0, len(PART_LENGTHS)))
    combined = combine_metrics(part_metrics(rows) for rows in part_slices())
    assert_same_values(combined.values, whole.values)
    assert combined.counts == whole.counts
    assert whole.values["clip_ratio/high_max"] > whole.values["clip_ratio/high_mean"] > 0
    assert math.isnan(part_metrics(part_slices()[1]).values["sampling/importance_sampling_ratio/min"])  # empty


def test_combine_metrics_rules():
    from driver.metrics.combine import Metrics, combine_metrics

    parts = [Metrics({"loss": 0.5, "grad_norm": 2.0, "x/min": 0.3, "y_max": math.nan, "entropy": 1.0},
                     {"entropy": 3.0}),
             Metrics({"loss": 0.25, "grad_norm": 4.0, "x/min": 0.1, "y_max": 7.0, "entropy": 2.0, "only_here": 9.0},
                     {"entropy": 1.0})]
    combined = combine_metrics(parts, summed=("loss",))
    assert combined.values == {"loss": 0.75, "grad_norm": 3.0, "x/min": 0.1, "y_max": 7.0,
                               "entropy": (1.0 * 3 + 2.0 * 1) / 4, "only_here": 9.0}
    assert combined.counts == {"entropy": 4.0}
    nothing = combine_metrics([Metrics({"a/max": math.nan, "b": 0.0}, {"b": 0.0})])
    assert math.isnan(nothing.values["a/max"]) and math.isnan(nothing.values["b"])
    with pytest.raises(ValueError, match="'entropy'"):
        combine_metrics([Metrics({"entropy": 1.0}, {"entropy": 2.0}), Metrics({"entropy": 1.0})])


def test_reduce_metrics_over_ranks_equals_one_process(monkeypatch):
    """Under torchrun each rank holds some micro-batches; reduce_metrics (its all_gather_object faked
    here) must give the metrics of one process holding them all, and sum the `summed` keys."""
    from driver.distributed import world as distributed
    from driver.metrics.combine import Metrics, combine_metrics

    ranks = [combine_metrics(part_metrics(rows) for rows in slices)
             for slices in (part_slices()[:2], part_slices()[2:3], part_slices()[3:])]
    for index, rank in enumerate(ranks):
        rank.update(Metrics({"loss": 0.1 * (index + 1), "grad_norm": 1.5}))

    def all_gather_object(out, obj):
        assert obj is ranks[0]
        out[:] = ranks

    monkeypatch.setattr(distributed, "_world", distributed.World(rank=0, size=len(ranks)))
    monkeypatch.setattr(distributed.dist, "all_gather_object", all_gather_object)
    reduced = distributed.reduce_metrics(ranks[0], summed=("loss",))
    expected = dict(part_metrics(slice(0, len(PART_LENGTHS))).values, loss=0.6, grad_norm=1.5)
    assert_same_values(reduced, expected)


def test_reduce_metrics_without_torchrun_returns_the_values():
    from driver.distributed.world import reduce_metrics
    from driver.metrics.combine import Metrics

    assert reduce_metrics(Metrics({"loss": 1.0, "entropy": 2.0}, {"entropy": 5.0})) == {"loss": 1.0, "entropy": 2.0}


def test_an_evaluation_has_its_own_line_merged_into_its_step_and_its_completions_file(tmp_path):
    from driver.metrics.plots import read_metrics

    with quiet_logger(tmp_path) as logger:
        logger.log(1, {"reward": 0.25})
        logger.log(2, {"reward": 0.5})
        time.sleep(0.05)  # the evaluation's time
        logger.log_eval(2, {"eval/reward": 0.75, "eval/time": 0.05}, [{"prompt": "p", "completion": "c"}])
        logger.log(3, {"reward": 0.6})
    rows = read_rows(tmp_path)
    evaluation = rows[2]
    assert evaluation["step"] == 2 and evaluation["eval/reward"] == 0.75 and "step_time" not in evaluation
    assert rows[3]["step_time"] < 0.05  # the evaluation is not the next step's time
    merged = read_metrics(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in merged] == [1, 2, 3]
    assert merged[1]["reward"] == 0.5 and merged[1]["eval/reward"] == 0.75
    completions = [json.loads(line) for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert completions == [{"step": 2, "prompt": "p", "completion": "c"}]
    assert not (tmp_path / "completions.jsonl").exists()


def test_resume_drops_evaluations_after_the_checkpoint(tmp_path):
    with quiet_logger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward": 0.0})
            logger.log_eval(step, {"eval/reward": float(step)}, [{"completion": str(step)}])
    with quiet_logger(tmp_path, start_step=2) as logger:
        pass
    completions = [json.loads(line)["step"] for line in (tmp_path / "eval_completions.jsonl").read_text().splitlines()]
    assert completions == [1, 2]
    assert [row.get("eval/reward") for row in read_rows(tmp_path)] == [None, 1.0, None, 2.0]
    with quiet_logger(tmp_path):  # a fresh run starts afresh
        pass
    assert not (tmp_path / "eval_completions.jsonl").exists()
