"""logging.quiet: what libraries print goes to run.log; the driver's own output stays on the terminal."""

import io
import logging
import os
import subprocess
import sys

import pytest
from rich.console import Console

from driver.metrics.console import library_output_to_file
from driver.metrics.logger import MetricsLogger


def test_library_output_goes_to_the_log_and_ours_to_the_terminal(tmp_path, capfd):
    log_path = tmp_path / "out" / "run.log"
    with library_output_to_file(log_path, enabled=True) as terminal:
        os.write(1, b"c-level write\n")  # what C++ code prints
        print("python print")
        subprocess.run([sys.executable, "-c", "import sys; print('child out'); print('child err', file=sys.stderr)"],
                       check=True)  # vLLM's engine processes inherit the descriptors
        library = logging.getLogger("transformers.fake")  # transformers adds its handler on first use
        library.addHandler(logging.StreamHandler())
        library.warning("a library warning")
        library.handlers.clear()
        logging.getLogger("driver.fake").warning("a driver warning")
        terminal.out.write("progress bar\n")
        assert terminal.log_path == log_path
    print("after the block")
    captured = capfd.readouterr()
    log = log_path.read_text()
    for line in ("c-level write", "python print", "child out", "child err", "a library warning"):
        assert line in log and line not in captured.out + captured.err, line
    assert "progress bar" in captured.out and "after the block" in captured.out
    assert "WARNING: a driver warning" in captured.err and "a driver warning" not in log


def test_an_error_is_logged_with_its_traceback_and_the_descriptors_come_back(tmp_path, capfd):
    log_path = tmp_path / "run.log"
    with pytest.raises(ValueError, match="boom"):
        with library_output_to_file(log_path, enabled=True):
            raise ValueError("boom")
    print("terminal again")
    assert "Traceback" in log_path.read_text() and "ValueError: boom" in log_path.read_text()
    assert "terminal again" in capfd.readouterr().out
    assert not logging.getLogger("driver").handlers  # nothing left behind


def test_disabled_leaves_everything_on_the_terminal(tmp_path, capfd):
    with library_output_to_file(tmp_path / "run.log", enabled=False) as terminal:
        os.write(1, b"c-level write\n")
        assert terminal.log_path is None and terminal.out is sys.stdout
    assert "c-level write" in capfd.readouterr().out
    assert not (tmp_path / "run.log").exists()


@pytest.mark.parametrize("quiet", [True, False])
def test_prints_during_the_progress_bar_stay_where_python_writes_them(tmp_path, monkeypatch, quiet):
    """On a terminal rich's live display replaces sys.stdout / sys.stderr with proxies that print above the
    bar. With logging.quiet those streams are run.log: a reward function's print or a warning written while
    the bar runs must stay there; with quiet off they are the terminal, and the proxy keeps the bar whole."""
    terminal, log = io.StringIO(), io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=100)
    monkeypatch.setattr(sys, "stdout", log if quiet else terminal)
    monkeypatch.setattr(sys, "stderr", log if quiet else terminal)
    with MetricsLogger(tmp_path, total_steps=2, tensorboard=False, console=console) as logger:
        print("a reward function's print")
        print("a warning", file=sys.stderr)
        logger.log(1, {"reward": 0.5})
    if quiet:
        assert log.getvalue() == "a reward function's print\na warning\n"
        assert "print" not in terminal.getvalue() and "step" in terminal.getvalue()
    else:
        assert "a reward function's print" in terminal.getvalue()
