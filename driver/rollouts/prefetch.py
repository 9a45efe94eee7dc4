"""A background thread that produces generation jobs ahead of the trainer.

The thread starts job j only when `ready(j)` holds (the schedule's version is served and the
trainer has assembled job j - depth - 1: driver/rollouts/feed.py), so which version samples which job
never depends on timing. The trainer's get(j) blocks until job j is produced, and re-raises in the
main thread whatever the thread raised. stop() cannot interrupt a call into the engine: it waits for
the job in progress to finish (a job is bounded by max_tokens), so the thread never holds the
engine when the process shuts it down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

POLL_S = 0.2  # how often a waiting get() looks at its `abandon` callback (Ctrl-C)


class Prefetcher:
    def __init__(self, produce: Callable[[int], object], first_job: int, ready: Callable[[int], bool]) -> None:
        self.condition = threading.Condition()  # guards everything below, and what ready() reads
        self._produce, self._ready = produce, ready
        self._jobs: dict[int, object] = {}
        self._next = first_job  # the job the thread works on or waits for
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rollout-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self._stopping or self._ready(self._next))
                if self._stopping:
                    return
                job = self._next
            try:
                produced = self._produce(job)
            except BaseException as error:  # noqa: BLE001 - handed to the main thread, which raises it
                with self.condition:
                    self._error = error
                    self.condition.notify_all()
                return
            with self.condition:
                self._jobs[job] = produced
                self._next = job + 1
                self.condition.notify_all()

    def notify(self) -> None:
        """Call after changing what ready() reads (under `condition`, or here)."""
        with self.condition:
            self.condition.notify_all()

    def wait_produced(self, count: int) -> None:
        """Block until jobs 0 .. count - 1 are produced (or the thread failed)."""
        with self.condition:
            self.condition.wait_for(lambda: self._next >= count or self._error is not None or self._stopping)
            self._raise_error()

    def get(self, job: int, abandon: Callable[[], bool] = lambda: False):
        """Job `job` once produced, or None when `abandon()` turns true while waiting."""
        with self.condition:
            while job not in self._jobs:
                self._raise_error()
                if abandon():
                    return None
                self.condition.wait(POLL_S)
            return self._jobs.pop(job)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        with self.condition:
            self._stopping = True
            self.condition.notify_all()
        self._thread.join()
