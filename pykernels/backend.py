"""One switch between our compiled kernels and the pure-torch references, for every op.

    pykernels.backend.set_kernels("reference")   # e.g. to rule kernels out while debugging
    pykernels.backend.set_kernels("auto")        # compiled kernels where they exist (default)
"""

from __future__ import annotations

import contextlib

MODES = ("auto", "reference")
_mode = "auto"


def set_kernels(mode: str) -> None:
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    _mode = mode


def kernels() -> str:
    return _mode


def use_reference() -> bool:
    return _mode == "reference"


@contextlib.contextmanager
def kernels_mode(mode: str):
    previous = _mode
    set_kernels(mode)
    try:
        yield
    finally:
        set_kernels(previous)
