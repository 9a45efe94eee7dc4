"""Reward functions for the reward pool tests: each misbehaves only when a completion carries its
marker, so one pool configured with all of them scores ordinary groups normally.

Imported by every reward worker, so no torch here. Rewards that must act only once per test
remember it with a file in `marker_dir`, a dataset column holding the test's tmp directory (a
retried call usually runs in another process, so memory would not do).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

SLOW_SECONDS = 3.0  # longer than the tests' pool timeout: the answer would come, but too late
LATE_ANSWER = 99.0  # what a slowed-down call would have returned; must never reach a result


def _marked(completions: list[str], marker: str) -> bool:
    return any(marker in completion for completion in completions)


def _first_time(marker_dir: str, name: str) -> bool:
    """True once per marker directory (the file is created exclusively, so exactly one caller wins)."""
    try:
        (Path(marker_dir) / name).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def length_or_none(completions, **columns):
    return [float(len(completion)) if completion else None for completion in completions]


def matches_answer(completions, answer, **columns):
    return [1.0 if completion == expected else 0.0 for completion, expected in zip(completions, answer)]


def alarm_in_main_thread(completions, **columns):
    """Times itself with SIGALRM as math_verify does: 1.0 on the main thread (signal.signal raises
    anywhere else), -1.0 when it finds an alarm left armed by an earlier call."""
    previous_handler = signal.signal(signal.SIGALRM, _alarm_fired)
    leftover = signal.alarm(30)
    try:
        on_main_thread = threading.current_thread() is threading.main_thread()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous_handler)
    value = -1.0 if leftover else 1.0 if on_main_thread else 0.0
    return [value for _ in completions]


def _alarm_fired(signum, frame):
    raise TimeoutError("reward alarm fired")


def arm_alarm_on_marker(completions, **columns):
    """ARM_ALARM: returns with an alarm still armed, as a careless reward would."""
    if _marked(completions, "ARM_ALARM"):
        signal.signal(signal.SIGALRM, _alarm_fired)
        signal.alarm(30)
    return [0.0 for _ in completions]


def slow_once(completions, marker_dir, **columns):
    """SLOW_ONCE: the first call outlives the timeout (and would answer LATE_ANSWER); the retry is quick."""
    if _marked(completions, "SLOW_ONCE") and _first_time(marker_dir[0], "slow_once"):
        time.sleep(SLOW_SECONDS)
        return [LATE_ANSWER for _ in completions]
    return [2.0 for _ in completions]


def hang_on_marker(completions, **columns):
    """HANG_ALWAYS: never returns."""
    while _marked(completions, "HANG_ALWAYS"):
        time.sleep(3600)
    return [0.0 for _ in completions]


def crash_on_marker(completions, **columns):
    """CRASH_ALWAYS: the process exits at once, as a segfault or an OOM kill would end it."""
    if _marked(completions, "CRASH_ALWAYS"):
        os._exit(3)
    return [0.0 for _ in completions]


def crash_once(completions, marker_dir, **columns):
    """CRASH_ONCE: the first call ends its process; the retry succeeds."""
    if _marked(completions, "CRASH_ONCE") and _first_time(marker_dir[0], "crash_once"):
        os._exit(3)
    return [0.0 for _ in completions]


def raise_on_marker(completions, **columns):
    if _marked(completions, "RAISE"):
        raise ValueError("raise_on_marker refuses this completion")
    return [0.0 for _ in completions]


def wrong_length_on_marker(completions, **columns):
    return [1.0] if _marked(completions, "WRONG_LENGTH") else [0.0 for _ in completions]


def sleep_then_length(completions, **columns):
    """0.2 s per call, then each completion's length: the pump test's stand-in for a slow verifier."""
    import time

    time.sleep(0.2)
    return [float(len(text)) for text in completions]


def conversational_digit_fraction(prompts, completions, **columns):
    """digit_fraction that first insists on TRL's conversational format: the prompt's messages and each
    completion as [{"role": "assistant", "content": ...}] (a plain string here means the format was lost)."""
    from driver.data.toy_tasks import digit_fraction

    for prompt, completion in zip(prompts, completions):
        if not (isinstance(prompt, list) and prompt[0]["role"] == "system" and prompt[-1]["role"] == "user"):
            raise TypeError(f"expected the prompt's messages, got {prompt!r}")
        if not (isinstance(completion, list) and len(completion) == 1 and completion[0]["role"] == "assistant"):
            raise TypeError(f"expected [{{'role': 'assistant', 'content': ...}}], got {completion!r}")
    return digit_fraction(prompts, completions)


# Two async rewards that finish only if they run concurrently: each waits at a two-party barrier of the
# call's event loop (sequential awaiting would time out in the first one).
_BARRIERS: dict = {}


async def _meet_the_other_reward():
    import asyncio

    loop = asyncio.get_running_loop()
    barrier = _BARRIERS.setdefault(id(loop), asyncio.Barrier(2))
    await asyncio.wait_for(barrier.wait(), timeout=5)


async def async_length(completions, **columns):
    await _meet_the_other_reward()
    return [float(len(c)) for c in completions]


async def async_constant(completions, **columns):
    await _meet_the_other_reward()
    return [1.0 for _ in completions]


async def async_raises(completions, **columns):
    raise ValueError("judge unavailable")


def raise_on_river(prompts, completions, **columns):
    """Fails for prompts that mention a river: a reward that cannot score part of an evaluation set."""
    if any("river" in prompt for prompt in prompts):
        raise ValueError("raise_on_river refuses this prompt")
    return [1.0 for _ in completions]


def training_progress(completions, trainer_state, **columns):
    """TRL's trainer_state as a reward reads it: global_step + max_steps / 1000, one number."""
    value = trainer_state.global_step + trainer_state.max_steps / 1000
    return [value for _ in completions]


def training_epoch(completions, trainer_state, **columns):
    return [float(trainer_state.epoch) for _ in completions]
