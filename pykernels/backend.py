"""Per op, our compiled kernel or the torch call it replaces: ``auto | ours | torch``.

    pykernels.backend.set_kernels("auto")               # every op (the default)
    pykernels.backend.set_kernels(lora="torch")         # one op; the others keep their mode
    pykernels.backend.set_kernels("ours", moe="torch")  # a default for all, then overrides
    PYKERNELS_KERNELS="auto,lora=torch" python ...      # the same, from the environment

Ops: nf4 (dequantize), lora (lora_linear), moe (experts_forward), logprobs (token_logprobs).
``auto`` lets pykernels.dispatch check and time ours against torch per (device, dtype, shape
bucket) on CUDA and keep the faster correct one; on CPU it means ours (the CPU kernels are gated
by benchmarks). ``reference`` is the old spelling of ``torch`` for every op. See
docs/kernels-dispatch.md.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

OPS = ("nf4", "lora", "moe", "logprobs")
OP_MODES = ("auto", "ours", "torch")
MODES = ("auto", "reference", "ours", "torch")  # accepted for every op at once
ENV_VAR = "PYKERNELS_KERNELS"

def _check_mode(op: str, mode: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (ops: {', '.join(OPS)})")
    if mode not in OP_MODES:
        raise ValueError(f"kernels for op {op!r} must be one of {OP_MODES}, got {mode!r}")
    return mode


def parse(spec: str, source: str = ENV_VAR) -> dict[str, str]:
    """"auto" | "reference" | "lora=torch,moe=ours" | "ours,logprobs=torch" -> {op: mode} (every op
    when a bare mode is given). Errors name the entry, the op and the allowed values."""
    modes: dict[str, str] = {}
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        op, sep, mode = (part.strip() for part in entry.partition("="))
        if not sep:
            if op not in MODES:
                raise ValueError(f"{source}: kernels must be one of {MODES} or op=mode, got {entry!r}")
            modes.update(dict.fromkeys(OPS, "torch" if op == "reference" else op))
            continue
        try:
            modes[op] = _check_mode(op, mode)
        except ValueError as error:
            raise ValueError(f"{source}: {error} (in {entry!r})") from None
    return modes


def environment_modes() -> dict[str, str]:
    """The ops PYKERNELS_KERNELS sets (empty when unset)."""
    return parse(os.environ.get(ENV_VAR, ""))


_modes: dict[str, str] = {**dict.fromkeys(OPS, "auto"), **environment_modes()}
_forced = threading.local()  # op -> "ours" | "torch" while pykernels.dispatch runs the side it chose


def set_kernels(mode: str | None = None, **per_op: str) -> None:
    """Set every op to ``mode`` (auto, ours, torch; reference = torch), then each op given by name."""
    new = dict(_modes)
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
        new.update(dict.fromkeys(OPS, "torch" if mode == "reference" else mode))
    for op, op_mode in per_op.items():
        new[op] = _check_mode(op, op_mode)
    _modes.update(new)


def mode(op: str) -> str:
    """The configured mode of ``op`` (auto, ours or torch)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r} (ops: {', '.join(OPS)})")
    return _modes[op]


def modes() -> dict[str, str]:
    return dict(_modes)


def kernels() -> str:
    """One word for all ops when they agree (torch is reported as "reference", as before), else
    "op=mode,..."."""
    values = set(_modes.values())
    if len(values) == 1:
        value = values.pop()
        return "reference" if value == "torch" else value
    return ",".join(f"{op}={_modes[op]}" for op in OPS)


def use_reference(op: str | None = None) -> bool:
    """Whether ``op`` runs on torch now: the side pykernels.dispatch chose while it runs one, else
    the configured mode (auto without dispatch means ours). Without ``op``: every op on torch."""
    if op is None:
        return all(value == "torch" for value in _modes.values())
    if torch.compiler.is_compiling():  # traced: the configured mode, a trace-time constant
        return _modes[op] == "torch"
    forced = getattr(_forced, op, None)
    return (forced or _modes[op]) == "torch"


def forced_side(op: str) -> str | None:
    """The side pykernels.dispatch is running ``op`` on in this thread, or None."""
    return getattr(_forced, op, None)


@contextlib.contextmanager
def forced(op: str, side: str):
    """Run ``op`` on ``side`` (ours | torch) in this thread, whatever is configured."""
    previous = getattr(_forced, op, None)
    setattr(_forced, op, side)
    try:
        yield
    finally:
        setattr(_forced, op, previous)


@contextlib.contextmanager
def kernels_mode(mode: str | None = None, **per_op: str):
    """set_kernels(mode, **per_op) inside the block; every op's mode restored after it."""
    previous = dict(_modes)
    set_kernels(mode, **per_op)
    try:
        yield
    finally:
        _modes.update(previous)
