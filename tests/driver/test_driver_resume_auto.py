"""checkpoint.resume: auto (axolotl's auto_resume_from_checkpoints): one command starts the run where output_dir
holds no checkpoint and resumes the newest where it does, as a requeued job reruns it; a run already at
train.steps stops before anything starts. The oracle: a run of the same steps uninterrupted, whose adapter the
resumed one equals bit for bit (checkpoint.keep's two checkpoints are there: resuming the older would differ).
(The preemption that requeues it, SIGTERM: tests/driver/test_driver_interrupt.py, and end to end in
tests/e2e/test_driver_e2e.py.)"""

import json

import driver.train


def argv(output_dir, steps: int) -> list[str]:
    return ["--rollout.backend=transformers", "--rollout.sampling.max_tokens=4", f"--train.steps={steps}",
            "--train.prompts_per_step=2", "--algo.num_generations=2", "--checkpoint.every=1",
            "--checkpoint.resume=auto", f"--logging.output_dir={output_dir}", "--logging.report_to=[]",
            "--logging.plots=false", "--logging.quiet=false", "--logging.progress=false"]


def printed_by(capsys) -> str:
    return " ".join(capsys.readouterr().out.split())  # rich wraps long lines (COLUMNS: not within a path)


def trained_steps(output_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_command_starts_resumes_the_newest_checkpoint_and_stops_once_complete(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    assert driver.train.main(argv(straight, 3)) == 0
    capsys.readouterr()

    assert driver.train.main(argv(requeued, 2)) == 0  # preempted after step 2, as it were
    assert f"checkpoint.resume: auto: no checkpoint in {requeued / 'checkpoints'}, starting at step 0" in \
        printed_by(capsys)
    assert sorted(path.name for path in (requeued / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert driver.train.main(argv(requeued, 3)) == 0  # the job's command again
    assert f"resumed at step 2 from {requeued / 'checkpoints' / 'step-000002'}" in printed_by(capsys)
    assert trained_steps(requeued) == [1, 2, 3]
    adapter = "adapter/adapter_model.safetensors"
    assert (requeued / adapter).read_bytes() == (straight / adapter).read_bytes()

    assert driver.train.main(argv(requeued, 3)) == 0  # and once more, after it finished
    assert "the run is complete (step 3, train.steps = 3): nothing to train; raise train.steps to train on" in \
        printed_by(capsys)
    assert trained_steps(requeued) == [1, 2, 3]

