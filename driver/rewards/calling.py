"""One reward call: every configured function on the same keyword arguments, in order. A function
defined with `async def` (e.g. one that asks a judge model over HTTP) returns a coroutine; those of a
call are awaited together on one event loop, so their waits overlap instead of adding up.

Shared by the in-process scorer and the worker processes (driver/rewards/pool.py, worker.py): no
torch here, a worker imports this before any reward."""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Callable, Sequence


class RewardCallFailed(Exception):
    """Reward function `index` raised; `trace` is its formatted traceback."""

    def __init__(self, index: int, trace: str) -> None:
        super().__init__(trace)
        self.index, self.trace = index, trace


def call_rewards(functions: Sequence[Callable], kwargs: dict,
                 started: Callable[[int], None] | None = None) -> list:
    """Each function's return value, in function order; `started(index)` before each is called."""
    values, pending = [], {}
    for index, function in enumerate(functions):
        if started is not None:
            started(index)
        try:
            value = function(**kwargs)
        except Exception as error:
            _close(pending.values())
            raise RewardCallFailed(index, traceback.format_exc()) from error
        if inspect.isawaitable(value):
            pending[index] = value
        values.append(value)
    if pending:
        outcomes = asyncio.run(_gather(list(pending.values())))
        for index, outcome in zip(pending, outcomes):
            if isinstance(outcome, BaseException):
                raise RewardCallFailed(index, "".join(traceback.format_exception(outcome)))
            values[index] = outcome
    return values


async def _gather(awaitables: list) -> list:
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _close(awaitables) -> None:
    """Coroutines never awaited (a later function raised first) are closed, not left to warn."""
    for awaitable in awaitables:
        if inspect.iscoroutine(awaitable):
            awaitable.close()
