"""Ctrl-C, or SIGTERM (what `docker stop`, Kubernetes and a SLURM preemption send first), finishes (or abandons)
the current step, saves a checkpoint and exits cleanly, so `checkpoint.resume=auto` continues from there; the
same signal again stops immediately. A run killed before it could save (a step that outlasts the grace period
before SIGKILL) resumes from the checkpoint before, which is whole: checkpoints are renamed into place once
written."""

from __future__ import annotations

import signal
import sys
from typing import TextIO

HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulInterrupt:
    def __init__(self, out: TextIO | None = None) -> None:
        self.signal: int | None = None  # the first one received
        self._previous: dict[int, object] = {}
        self._out = out  # the terminal (driver/metrics/console.py); sys.stdout when None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.signal = signum
        what, again = (("interrupt", "Ctrl-C again") if signum == signal.SIGINT else
                       (signal.Signals(signum).name, "again"))
        print(f"\n{what}: stopping after this step and saving a checkpoint ({again} to abort)",
              file=self._out or sys.stdout, flush=True)

    def __enter__(self) -> GracefulInterrupt:
        self._previous = {signum: signal.signal(signum, self._handle) for signum in HANDLED}
        return self

    def __exit__(self, *_exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
