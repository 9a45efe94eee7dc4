"""The child side of the reward pool (driver/rewards/pool.py): one spawned process that imports the
reward functions once and then runs one call at a time, each call being every function on one group.

This module is what every worker imports, so it stays light: no torch (the values go back raw and
are checked in the parent). `serve` runs as Process.run, which with the spawn start method is the
child's MAIN thread, so reward functions that time themselves with signal.alarm (math_verify does)
work here; they would raise "signal only works in main thread" in any other thread.

Protocol over the pipe (parent -> worker): a list of (dotted path, factory kwargs or None), then
(call_id, kwargs) per call,
then None to stop. Worker -> parent:
    ("ready",)                             functions imported, waiting for calls
    ("import_failed", traceback)           could not import them; the worker exits
    ("start", call_id, index)              about to run function `index` (names the one that hangs)
    ("done", call_id, values)              every function's return value, in config order
    ("raised", call_id, index, traceback)  function `index` raised: deterministic, not retried
Every reply carries the call id, so the parent can drop any answer that is not for its current call.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from driver.rewards.calling import RewardCallFailed, call_rewards


def serve(conn: Connection) -> None:
    # Ctrl-C reaches every process in the terminal's group; the trainer decides what it means, and
    # stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _one_thread()
    try:
        functions = _import_functions(conn.recv())
    except Exception:
        conn.send(("import_failed", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        call_id, kwargs = message
        _run_call(conn, functions, call_id, kwargs)


def _one_thread() -> None:
    """Workers share the machine with the trainer: one OpenMP / BLAS thread each. The environment
    covers libraries the rewards load later; torch is only set when it is already loaded (the pool
    starts workers without the parent's __main__, so only an import of the rewards could load it)."""
    for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[variable] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _import_functions(specs: list[tuple[str, dict | None]]) -> list:
    from driver.cli import reward_function  # yaml + pydantic, no torch

    return [reward_function(path, kwargs, f"rewards.functions[{index}].path")
            for index, (path, kwargs) in enumerate(specs)]


def _run_call(conn: Connection, functions: list, call_id: int, kwargs: dict) -> None:
    index = 0

    def started(function_index: int) -> None:
        nonlocal index
        index = function_index
        conn.send(("start", call_id, function_index))

    try:
        values = call_rewards(functions, kwargs, started)
        conn.send(("done", call_id, values))  # pickling happens before any byte is written
    except RewardCallFailed as failure:
        conn.send(("raised", call_id, failure.index, failure.trace))
    except BaseException:  # SystemExit too: a reward calling sys.exit is a bug to report, not a crash
        conn.send(("raised", call_id, index, traceback.format_exc()))
    finally:
        # A reward that armed an alarm and did not cancel it must not fire during a later call.
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
