"""Ctrl-C finishes (or abandons) the current step, saves a checkpoint and exits cleanly; a second
Ctrl-C stops immediately."""

from __future__ import annotations

import signal


class GracefulInterrupt:
    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to abort)", flush=True)

    def __enter__(self) -> GracefulInterrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
