"""Ctrl-C finishes (or abandons) the current step, saves a checkpoint and exits cleanly; a second
Ctrl-C stops immediately."""

from __future__ import annotations

import signal
import sys
from typing import TextIO


class GracefulInterrupt:
    def __init__(self, out: TextIO | None = None) -> None:
        self.requested = False
        self._previous = None
        self._out = out  # the terminal (driver/metrics/console.py); sys.stdout when None

    def _handle(self, _signum, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to abort)",
              file=self._out or sys.stdout, flush=True)

    def __enter__(self) -> GracefulInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
