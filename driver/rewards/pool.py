"""Reward calls keyed by group, scored in persistent spawned worker processes (`reward_num_workers`)
or in the calling thread (0 workers), behind one interface: submit(key, kwargs), poll(), wait(keys).

One call = every reward function on one group's G completions (kwargs from rewards.group_call).
Workers (driver/rewards/worker.py) are spawned, not forked: the trainer holds threads, OpenMP pools
and engine sockets that a fork would copy half-alive; spawn also runs the call in the child's main
thread, where signal.alarm works (math_verify times itself with it).

Failures, and what each costs:
  - a reward raises, or returns something that is not N numbers-or-None: deterministic, so no
    retry; the result carries the traceback or RewardFunctions' message, and the caller decides.
  - a call outlives `timeout` (counted from when a worker received it, not from submit), or the
    worker dies (os._exit, segfault, OOM kill): the worker is killed and replaced, and the call is
    retried `retries` times before its result reports which reward failed, how, and on what input.
Never stale: each call sent gets a fresh call id and a worker's replies are dropped unless they
carry its current call's id; a replaced worker's pipe is closed before its successor starts, so a
killed call's answer cannot be read at all.

Use a scorer from one thread. There is no background thread: queued calls are handed to free
workers, answers read and deadlines checked inside submit(), poll() and wait(), so a caller with
queued work polls regularly.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import signal
import sys
import time
import types
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_ready

import torch

from driver.config import RewardsConfig
from driver.rewards import worker as reward_worker
from driver.rewards.calling import RewardCallFailed, call_rewards
from driver.rewards.functions import RewardError, RewardFunctions, reward_table

COUNTERS = ("worker_restarts", "timeouts", "crashes", "retries", "failed_calls", "stale_replies")
INPUT_CHARS = 200  # of the prompt and of the first completion, quoted in a failure
CLOSE_GRACE = 2.0  # seconds an idle worker gets to exit after the stop message before it is killed


@dataclass
class RewardResult:
    key: int  # the caller's id for the call (a group id)
    table: torch.Tensor | None  # [G, F] float32, NaN where a function returned None; None on failure
    failure: str | None  # which reward failed, how, and on what input; None on success


def describe_input(kwargs: dict) -> str:
    prompts, completions = kwargs.get("prompts") or [""], kwargs.get("completions") or [""]

    def cut(text: str) -> str:
        return repr(text[:INPUT_CHARS]) + ("..." if len(text) > INPUT_CHARS else "")

    return f"input: prompt {cut(prompts[0])}, first of {len(completions)} completions {cut(completions[0])}"


class _KeyedResults:
    """What both scorers share: results held by key until poll() or wait() hands them out."""

    def __init__(self, config: RewardsConfig, device: str = "auto") -> None:
        # Importing the functions here too gives their names and fails on a bad path now, with the
        # config's message, rather than in a worker.
        self._functions = RewardFunctions(config, device)
        self.names, self.weights = self._functions.names, self._functions.weights
        self._keys: set = set()  # submitted, not yet handed out
        self._results: dict[int, RewardResult] = {}  # finished, in finishing order
        self._counts = dict.fromkeys(COUNTERS, 0)

    def _accept(self, key: int, kwargs: dict) -> None:
        if not isinstance(kwargs, dict) or "completions" not in kwargs:
            raise ValueError(f"reward call {key}: kwargs must be a dict with 'completions' (see rewards.group_call)")
        if key in self._keys:
            raise ValueError(f"reward call {key} was already submitted and not yet collected")
        self._keys.add(key)

    def _take(self, keys: Iterable[int]) -> list[RewardResult]:
        results = [self._results.pop(key) for key in list(keys)]
        self._keys.difference_update(result.key for result in results)
        return results

    def _scored(self, key: int, values: list, kwargs: dict) -> RewardResult:
        try:
            return RewardResult(key, reward_table(self.names, values, kwargs["completions"]), None)
        except RewardError as error:
            return self._failed(key, f"{error}\n{describe_input(kwargs)}")

    def _raised(self, key: int, index: int, trace: str, kwargs: dict) -> RewardResult:
        return self._failed(key, f"reward '{self.names[index]}' raised an exception\n{trace}{describe_input(kwargs)}")

    def _failed(self, key: int, failure: str) -> RewardResult:
        self._counts["failed_calls"] += 1
        return RewardResult(key, None, failure)

    def _check_submitted(self, keys: list) -> None:
        missing = [key for key in keys if key not in self._keys]
        if missing:
            raise ValueError(f"reward calls {missing} were never submitted (or were already collected)")

    def poll(self, timeout: float = 0.0) -> list[RewardResult]:
        """Every call finished since the last poll or wait, waiting up to `timeout` s for a first one."""
        self._progress(timeout, lambda: bool(self._results))
        return self._take(list(self._results))

    def wait(self, keys: Iterable[int]) -> dict[int, RewardResult]:
        """Blocks until every one of `keys` is finished; other results stay for a later poll or wait."""
        keys = list(keys)
        self._check_submitted(keys)
        self._progress(math.inf, lambda: all(key in self._results for key in keys))
        return {result.key: result for result in self._take(keys)}

    def _progress(self, timeout: float, done) -> None:
        """Runs submitted calls until done() or `timeout` s; inline calls all ran at submit()."""

    def metrics(self) -> dict[str, float]:
        """Counters since construction."""
        return {f"rewards/{name}": float(count) for name, count in self._counts.items()}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class InlineRewards(_KeyedResults):
    """reward_num_workers = 0: each call runs at submit(), in the calling thread, which must then be
    the main thread for rewards that use signal.alarm. No timeout: nothing can stop it safely there."""

    def submit(self, key: int, kwargs: dict) -> None:
        self._accept(key, kwargs)
        self._results[key] = self._score(key, kwargs)

    def _score(self, key: int, kwargs: dict) -> RewardResult:
        try:
            values = call_rewards(self._functions.functions, kwargs)
        except RewardCallFailed as failure:
            return self._raised(key, failure.index, failure.trace, kwargs)
        return self._scored(key, values, kwargs)


@contextlib.contextmanager
def main_module_hidden():
    """Spawn re-imports the parent's __main__ in every child (`python -m driver.train`: torch,
    transformers, pykernels; ~4 s a worker here). The worker needs none of it (its target and the
    reward functions are imported by name), so while it starts __main__ is a bare module."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


@dataclass
class _Call:
    key: int
    kwargs: dict
    errors: list[str] = field(default_factory=list)  # one per timed-out or crashed attempt


class _Worker:
    def __init__(self, context, specs: list[tuple[str, dict | None]], startup_timeout: float) -> None:
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=reward_worker.serve, args=(child_conn,), daemon=True,
                                       name="reward-worker")
        with main_module_hidden():
            self.process.start()
        child_conn.close()  # the parent's copy, or a dead worker's pipe would never read as EOF
        self.conn.send(specs)
        self.ready = False
        self.call: _Call | None = None
        self.call_id: int | None = None  # the id of `call` as sent; replies with any other id are dropped
        self.function_index = 0  # the function the worker last said it started
        self.deadline = time.monotonic() + startup_timeout  # to become ready, then to finish `call`

    def stop(self) -> None:
        """Kill (not terminate: a reward stuck in C code ignores SIGTERM), reap, close the pipe."""
        self.process.kill()
        self.process.join()
        self.conn.close()
        self.process.close()

    def exit_description(self) -> str:
        self.process.join(timeout=1.0)  # the pipe closes a moment before the process is reapable
        code = self.process.exitcode
        if code is None:
            return "the worker closed its pipe"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class RewardPool(_KeyedResults):
    """`num_workers` spawned reward workers, one call in flight on each; see the module docstring."""

    def __init__(self, config: RewardsConfig, num_workers: int, timeout: float, retries: int = 1,
                 startup_timeout: float = 120.0) -> None:
        if num_workers < 1 or timeout <= 0 or retries < 0:
            raise ValueError(f"RewardPool needs num_workers >= 1, timeout > 0, retries >= 0; got "
                             f"{num_workers}, {timeout}, {retries}")
        super().__init__(config)
        self.timeout, self.retries, self.startup_timeout = timeout, retries, startup_timeout
        self._context = multiprocessing.get_context("spawn")
        self._call_ids = itertools.count()
        self._pending: deque[_Call] = deque()  # waiting for a free worker; retries go first
        self._closed = False
        self._workers: list[_Worker] = []
        try:
            # All started before any is waited for: they import the reward functions in parallel.
            for _ in range(num_workers):
                self._workers.append(self._start_worker())
            while not all(worker.ready for worker in self._workers):
                self._pump(math.inf)
        except BaseException:
            self.close()
            raise

    def submit(self, key: int, kwargs: dict) -> None:
        self._check_open()
        self._accept(key, kwargs)
        self._pending.append(_Call(key, kwargs))
        self._pump(0.0)

    def _progress(self, timeout: float, done) -> None:
        self._check_open()
        end = time.monotonic() + timeout
        self._pump(0.0)
        while not done() and self._busy() and (remaining := end - time.monotonic()) > 0:
            self._pump(remaining)

    def close(self) -> None:
        """Idle workers get a stop message and CLOSE_GRACE seconds; busy or late ones are killed."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            if worker.ready and worker.call is None:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
        end = time.monotonic() + CLOSE_GRACE
        for worker in self._workers:
            if worker.ready and worker.call is None:
                worker.process.join(max(0.0, end - time.monotonic()))
            worker.stop()

    @property
    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self._workers]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the reward pool is closed")

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self._functions.specs, self.startup_timeout)

    def _busy(self) -> bool:
        return bool(self._pending) or any(worker.call is not None for worker in self._workers)

    def _pump(self, timeout: float) -> None:
        """One round: hand out queued calls, wait up to `timeout` (or the nearest deadline) for a
        reply or a death, read every reply, act on passed deadlines, hand out again."""
        self._dispatch()
        watched = [worker for worker in self._workers if worker.call is not None or not worker.ready]
        if watched:
            horizon = min([timeout] + [worker.deadline - time.monotonic() for worker in watched])
            signalled = set(wait_for_ready([w.conn for w in watched] + [w.process.sentinel for w in watched],
                                           timeout=max(0.0, horizon)))
            for worker in watched:
                if worker.conn in signalled or worker.process.sentinel in signalled:
                    self._receive(worker)
            for worker in list(self._workers):
                if worker.deadline <= time.monotonic():
                    self._receive(worker)  # an answer that is already in the pipe still counts
                    if worker in self._workers and worker.deadline <= time.monotonic():
                        self._deadline_passed(worker)
        self._dispatch()

    def _dispatch(self) -> None:
        for worker in list(self._workers):
            if not self._pending:
                return
            if worker.ready and worker.call is None:
                call = self._pending.popleft()
                call_id = next(self._call_ids)
                try:
                    worker.conn.send((call_id, call.kwargs))
                except OSError:  # it died while idle: not this call's fault, so no attempt is spent
                    self._pending.appendleft(call)
                    self._replace(worker)
                    continue
                worker.call, worker.call_id, worker.function_index = call, call_id, 0
                worker.deadline = time.monotonic() + self.timeout

    def _receive(self, worker: _Worker) -> None:
        """Read every reply in the worker's pipe; a closed pipe or an exited process is a death."""
        try:
            while worker.conn.poll():
                self._handle(worker, worker.conn.recv())
        except (EOFError, OSError):
            pass
        else:
            if worker.process.is_alive():
                return
        why = worker.exit_description()
        if not worker.ready:
            raise RewardError(f"a reward worker died while starting ({why}; its stderr says why: often a "
                              "__main__ module that starts work outside `if __name__ == '__main__':`, "
                              "which every spawned worker re-imports)")
        self._counts["crashes"] += 1
        self._lost(worker, f"crashed the worker ({why})")

    def _handle(self, worker: _Worker, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready, worker.deadline = True, math.inf
        elif kind == "import_failed":
            raise RewardError(f"a reward worker could not import the reward functions:\n{message[1]}")
        elif worker.call is None or message[1] != worker.call_id:
            self._counts["stale_replies"] += 1  # an answer to a call this worker no longer runs
        elif kind == "start":
            worker.function_index = message[2]
        else:
            call = worker.call
            worker.call, worker.call_id, worker.deadline = None, None, math.inf
            if kind == "done":
                result = self._scored(call.key, message[2], call.kwargs)
            else:
                result = self._raised(call.key, message[2], message[3], call.kwargs)
            self._results[call.key] = result

    def _deadline_passed(self, worker: _Worker) -> None:
        if not worker.ready:
            raise RewardError(f"a reward worker did not start within {self.startup_timeout:g} s (importing "
                              f"the reward functions and the parent's __main__ module)")
        self._counts["timeouts"] += 1
        self._lost(worker, f"timed out after {self.timeout:g} s")

    def _lost(self, worker: _Worker, why: str) -> None:
        """A timed-out or dead worker is replaced; its call, if it had one, is retried or fails."""
        call = worker.call
        if call is not None:
            call.errors.append(f"reward '{self.names[worker.function_index]}' {why}")
        self._replace(worker)
        if call is None:
            return
        if len(call.errors) <= self.retries:
            self._counts["retries"] += 1
            self._pending.appendleft(call)  # ahead of newer calls: it has waited longest
        else:
            failure = f"{'; then '.join(call.errors)}\n{describe_input(call.kwargs)}"
            self._results[call.key] = self._failed(call.key, failure)

    def _replace(self, worker: _Worker) -> None:
        worker.stop()  # the pipe is closed first: the old call's late answer has nowhere to arrive
        self._workers[self._workers.index(worker)] = self._start_worker()
        self._counts["worker_restarts"] += 1


def make_reward_scorer(config: RewardsConfig, num_workers: int, timeout: float,
                       device: str = "auto") -> RewardPool | InlineRewards:
    """Worker processes for num_workers >= 1, else the calling thread (reward models only there, on
    `device`)."""
    return RewardPool(config, num_workers, timeout) if num_workers > 0 else InlineRewards(config, device)
