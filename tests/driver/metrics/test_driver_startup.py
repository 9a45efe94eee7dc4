"""What a run shows before its first step (driver/metrics/startup.py): a line per phase with what it did and
how long it took; a spinner with the elapsed time meanwhile on a terminal; nothing for a failed phase or on
other ranks. And Ctrl-C in that time: a one-line message and exit code 130, no traceback."""

import io
import re
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

import driver.train
from driver.config import Config
from driver.metrics.startup import StartupPhases, describe, format_seconds, human_count

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tiny-grpo.yaml"


def console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=300, color_system=None), out


def test_a_phase_leaves_one_line_with_what_it_did_and_its_time():
    terminal, out = console(terminal=False)
    phases = StartupPhases(terminal, spinner=True)  # a log file, not a terminal: no spinner frames
    loaded = []
    with phases.phase("loading the model", lambda: f"loaded {len(loaded)} things"):
        time.sleep(0.05)
        loaded += [1, 2, 3]  # `done` is worded after the body: it can say what the body loaded
    (line,) = out.getvalue().splitlines()
    seconds = re.fullmatch(r"loaded 3 things in (\d+\.\d) s", line).group(1)
    assert 0.05 <= float(seconds) < 5


def test_on_a_terminal_a_spinner_says_what_runs_until_the_line_replaces_it():
    terminal, out = console(terminal=True)
    with StartupPhases(terminal, spinner=True).phase("starting vLLM", "started vLLM"):
        time.sleep(0.3)  # the spinner refreshes 12.5 times a second
    text = out.getvalue()
    assert "starting vLLM 0." in text  # the spinner's text with the seconds so far
    assert text.rstrip().splitlines()[-1].endswith(" s") and "started vLLM in " in text


def test_what_python_writes_during_the_spinner_stays_in_the_log(monkeypatch):
    """sys.stdout / sys.stderr are run.log during the run: a library imported in a phase (vLLM, which binds
    its log handler to sys.stdout then) must not get rich's proxy to the terminal instead."""
    terminal, out = console(terminal=True)
    log = io.StringIO()
    monkeypatch.setattr(sys, "stdout", log)
    monkeypatch.setattr(sys, "stderr", log)
    with StartupPhases(terminal, spinner=True).phase("starting vLLM", "started vLLM"):
        print("INFO engine started")
        print("WARNING something", file=sys.stderr)
    assert log.getvalue() == "INFO engine started\nWARNING something\n"
    assert "engine" not in out.getvalue() and "WARNING" not in out.getvalue()


@pytest.mark.parametrize("spinner", [False, True])
def test_no_spinner_when_turned_off_and_nothing_for_a_phase_that_fails(spinner):
    terminal, out = console(terminal=True)
    phases = StartupPhases(terminal, spinner=spinner)
    with pytest.raises(RuntimeError, match="no such model"):
        with phases.phase("loading x", "loaded x"):
            raise RuntimeError("no such model")
    assert "loaded x" not in out.getvalue()
    assert ("loading x" in out.getvalue()) == spinner


def test_other_ranks_show_nothing():
    phases = StartupPhases(None, spinner=True)
    ran = []
    with phases.phase("loading x", lambda: ran.append("worded") or "loaded x"):
        ran.append("body")
    phases.print("a message")
    assert ran == ["body"]  # the body runs; nothing is worded for a console that is not there


@pytest.mark.parametrize("rollout, says", [
    ({"backend": "colocate"}, ["started vLLM in "]),
    ({"backend": "server"}, ["the vLLM server's output: {output_dir}/vllm-server.log", "launched a vLLM server in "]),
    ({"backend": "server", "server_url": "http://h:8000"}, ["connected to vLLM at http://h:8000 in "]),
    ({"backend": "server", "server_url": ["http://a:1", "http://b:2"]}, ["connected to vLLM at http://a:1, http://b:2"]),
    ({"backend": "transformers"}, []),  # generate runs on the trainer's model: nothing starts
])
def test_the_engine_phase_names_the_backend(tmp_path, rollout, says):
    terminal, out = console(terminal=False)
    config = Config.model_validate({"rollout": rollout, "logging": {"output_dir": str(tmp_path)}})
    with driver.train.engine_phase(StartupPhases(terminal, spinner=False), config):
        pass
    lines = out.getvalue().splitlines()
    assert len(lines) == len(says)
    for line, start in zip(lines, says):
        assert line.startswith(start.format(output_dir=tmp_path)), (line, start)


def test_counts_and_times_read_as_people_write_them():
    assert [human_count(n) for n in (0, 999, 1_234, 36_700_000, 7_615_616_512)] == ["0", "999", "1.2k", "36.7M",
                                                                                   "7.6B"]
    assert [format_seconds(s) for s in (0.04, 12.345, 59.94, 59.97, 61, 3600)] == [
        "0.0 s", "12.3 s", "59.9 s", "1m00s", "1m01s", "60m00s"]


def test_describe_counts_the_trainable_parameters_only():
    import torch

    class Policy:
        def trainable_parameters(self):
            return [torch.nn.Parameter(torch.zeros(1000, 37)), torch.nn.Parameter(torch.zeros(500))]

    assert describe(Policy()) == "37.5k trainable parameters"


def test_ctrl_c_before_the_first_step_exits_130_with_one_line(monkeypatch, tmp_path, capsys):
    def interrupted_load(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver.train, "load_policy", interrupted_load)
    with pytest.raises(SystemExit) as exit_info:
        driver.train.main([str(EXAMPLE), f"--logging.output_dir={tmp_path}", "--logging.quiet=false"])
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted: stopped without saving a checkpoint" in err and "Traceback" not in err
