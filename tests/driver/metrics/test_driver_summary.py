"""The end-of-run summary: the reward trend, where the outputs are, and the command to go on."""

import json

from driver.metrics.summary import run_summary


def write_rows(path, rewards, key="reward"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i + 1, key: r}) + "\n" for i, r in enumerate(rewards)))


def test_a_finished_run(tmp_path):
    out = tmp_path / "run"
    rewards = [0.1 * (i % 3) for i in range(40)]
    write_rows(out / "metrics.jsonl", rewards)
    text = run_summary(out, steps_done=40, steps_planned=40, wall_seconds=125.4, quiet=True, plots=True,
                       tensorboard=True)
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert text.splitlines()[0] == "finished step 40 of 40 in 2m05s"
    assert f"reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f}" in text
    for name in ("adapter", "metrics.jsonl", "plots", "tensorboard", "run.log"):
        assert str(out / name) in text
    assert "continue: " in text and f"{out / 'config.yaml'} --checkpoint.resume=latest --train.steps=80" in text


def test_an_interrupted_short_ebft_run_without_extras(tmp_path):
    out = tmp_path / "run"
    write_rows(out / "metrics.jsonl", [1.0, 3.0, 5.0], key="ebft/reward")
    text = run_summary(out, steps_done=3, steps_planned=100, wall_seconds=7, quiet=False, plots=False,
                       tensorboard=False)
    assert text.splitlines()[0] == "stopped at step 3 of 100 in 0m07s"
    assert "ebft/reward: first 1 steps 1.000 -> last 1 steps 5.000" in text
    assert "resume:" in text and "--train.steps" not in text
    assert "plots" not in text and "tensorboard" not in text and "run.log" not in text


def test_a_run_without_metrics_still_says_where_things_are(tmp_path):
    text = run_summary(tmp_path, steps_done=1, steps_planned=1, wall_seconds=1, quiet=True, plots=False,
                       tensorboard=False)
    assert "reward" not in text and str(tmp_path / "adapter") in text


def test_evaluations_are_summarized_first_to_last(tmp_path):
    out = tmp_path / "run"
    write_rows(out / "metrics.jsonl", [0.1, 0.2, 0.3, 0.4])
    with (out / "metrics.jsonl").open("a") as lines:  # evaluations: lines of their own at their steps
        for step, reward in ((0, 0.125), (2, 0.5), (4, 0.875)):
            lines.write(json.dumps({"step": step, "eval/reward": reward, "eval/prompts": 32.0}) + "\n")
    (out / "eval_completions.jsonl").write_text("")
    text = run_summary(out, steps_done=4, steps_planned=4, wall_seconds=3, quiet=False, plots=False,
                       tensorboard=False)
    assert "reward: first 2 steps 0.150 -> last 2 steps 0.350" in text  # the evaluations are not in it
    assert "eval/reward: 0.125 at step 0 -> 0.875 at step 4 (32 prompts)" in text
    assert str(out / "eval_completions.jsonl") in text
