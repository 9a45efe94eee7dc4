"""The terminal shows the run; the libraries' output goes to a log file (logging.quiet).

With quiet on, file descriptors 1 and 2 point at `output_dir/run.log` for the run: vLLM's engine
logs (its worker processes inherit the descriptors), transformers' and torch's warnings, C++
messages and anything a reward function prints land there. The progress bar, the step summaries,
the driver's own messages, warnings and errors go to the terminal through the streams this yields, which
write to copies of the original descriptors. Redirecting descriptors rather than `sys.stdout`
catches output from C++ and from child processes, which never see Python's stream objects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

LOG_FILE = "run.log"


@dataclass
class Terminal:
    out: TextIO
    err: TextIO
    log_path: Path | None  # where library output goes; None when it stays on the terminal


@contextlib.contextmanager
def library_output_to_file(log_path: Path, enabled: bool) -> Iterator[Terminal]:
    if not enabled:
        yield Terminal(sys.stdout, sys.stderr, None)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = Terminal(os.fdopen(os.dup(1), "w", buffering=1), os.fdopen(os.dup(2), "w", buffering=1), log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The driver's own warnings (logging.getLogger("driver.*")) are for the user, not library noise.
    ours = logging.StreamHandler(terminal.err)
    ours.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    ours.setLevel(logging.WARNING)
    python_streams = sys.stdout, sys.stderr
    with open(log_path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        # Python's streams too: they may not write to descriptors 1 and 2 (a notebook, pytest).
        sys.stdout = sys.stderr = log
        logging.getLogger("driver").addHandler(ours)
        try:
            yield terminal
        except BaseException:
            traceback.print_exc(file=log)  # the log has the whole story; the caller reports it on the terminal
            raise
        finally:
            logging.getLogger("driver").removeHandler(ours)
            sys.stdout, sys.stderr = python_streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.out.close()
            terminal.err.close()
