"""driver.metrics.plots: which PNGs are written, their names, and tolerance of gaps and broken files."""

import json
import math

import pytest
from PIL import Image

from driver.metrics.plots import MAIN_CURVES, curve, exponential_moving_average, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 7  # odd, so the overview grid and the EMA see a non-round count


def write_rows(path, rows) -> None:
    # allow_nan: the test writes NaN / Infinity tokens on purpose, as a foreign writer might
    path.write_text("".join(json.dumps(row, allow_nan=True) + "\n" for row in rows))


def assert_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_writes_one_png_per_present_key_and_an_overview(tmp_path):
    rows = [{"step": step, "reward": step / STEPS, "kl": 0.001 * step, "completions/mean_length": 40.0 + step,
             "not_a_main_curve": 1.0, "time": 0.0} for step in range(1, STEPS + 1)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    plots = tmp_path / "plots"
    assert written == [plots / "reward.png", plots / "kl.png", plots / "completions_mean_length.png",
                       plots / "overview.png"]
    assert sorted(path.name for path in plots.iterdir()) == sorted(path.name for path in written)
    for path in written:
        assert_png(path)


def test_all_main_curves_have_distinct_file_names(tmp_path):
    rows = [{"step": step, **{key: float(step) for key in MAIN_CURVES}} for step in range(1, STEPS + 1)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    assert len(set(written)) == len(MAIN_CURVES) + 1
    assert tmp_path / "plots" / "sampling_importance_sampling_ratio_mean.png" in written
    assert tmp_path / "plots" / "clip_ratio_region_mean.png" in written


def test_evaluation_lines_join_their_steps_and_draw_their_own_curve(tmp_path):
    rows = [{"step": step, "reward": step / STEPS} for step in range(1, STEPS + 1)]
    rows += [{"step": step, "eval/reward": 0.1 * step} for step in (0, 3, 6)]  # written after the steps' lines
    write_rows(tmp_path / "metrics.jsonl", rows)
    merged = read_metrics(tmp_path / "metrics.jsonl")
    assert curve(merged, "reward") == (list(range(1, STEPS + 1)), [step / STEPS for step in range(1, STEPS + 1)])
    assert curve(merged, "eval/reward") == ([0, 3, 6], [0.0, 0.1 * 3, 0.1 * 6])
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path)
    assert [path.name for path in written] == ["reward.png", "eval_reward.png", "overview.png"]
    for path in written:
        assert_png(path)


def test_custom_keys(tmp_path):
    rows = [{"step": step, "rewards/digit_fraction/mean": 0.1 * step} for step in range(1, STEPS + 1)]
    write_rows(tmp_path / "metrics.jsonl", rows)
    written = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "run", keys=["rewards/digit_fraction/mean"])
    assert [path.name for path in written] == ["rewards_digit_fraction_mean.png", "overview.png"]
    assert all(path.parent == tmp_path / "run" / "plots" for path in written)


def test_non_finite_values_are_tolerated(tmp_path):
    rewards = [0.1, None, math.nan, 0.4, math.inf, -math.inf, 0.7]
    rows = [{"step": step, "reward": reward, "kl": None, "loss": math.nan}
            for step, reward in zip(range(1, STEPS + 1), rewards)]
    path = tmp_path / "metrics.jsonl"
    write_rows(path, rows)
    with path.open("a") as file:
        file.write('{"step": 8, "rew')  # torn last line from a crash
    written = plot_metrics(path, tmp_path)
    # kl and loss have no finite value: no plot for them
    assert [path.name for path in written] == ["reward.png", "overview.png"]
    for path in written:
        assert_png(path)


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "metrics.jsonl"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        plot_metrics(missing, tmp_path)


def test_empty_file_writes_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path) == []
    assert not (tmp_path / "plots").exists()


def test_no_requested_key_present_writes_nothing(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "something_else": 1.0}])
    assert plot_metrics(tmp_path / "metrics.jsonl", tmp_path) == []


def test_ema_is_debiased_and_skips_gaps():
    assert exponential_moving_average([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    smoothed = exponential_moving_average([0.0, math.nan, 1.0], smoothing=0.5)
    assert smoothed[0] == 0.0 and math.isnan(smoothed[1])
    assert smoothed[2] == pytest.approx(0.5 / 0.75)  # average 0.5*0 + 0.5*1 over weight 0.5*0.5 + 0.5
