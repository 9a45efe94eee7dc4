"""The gate's self-test: a planted slowdown of ours, set from the environment, never in product code.

    PYKERNELS_BENCH_PLANT_SLOWDOWN=nf4.dequantize .venv/bin/python -m pytest --benchmark -k nf4

makes "ours" do its work twice in every benchmark whose "<family>.<op>.<case>" is the value or
starts with it followed by a dot ("nf4", "nf4.dequantize", "nf4.dequantize.4096x4096"; several
separated by commas). The gate must then fail the rules of those cases: a 2x slowdown of any
kernel is what its floors are set to catch (benchmarks/thresholds.toml). benchmarks/conftest.py
applies it in `measure`; the gate's summary says when it is set.
"""

from __future__ import annotations

import os
from collections.abc import Callable

PLANT_ENV = "PYKERNELS_BENCH_PLANT_SLOWDOWN"


def planted_selectors() -> list[str]:
    return [s.strip() for s in os.environ.get(PLANT_ENV, "").split(",") if s.strip()]


def is_planted(family: str, op: str, case: str, impl: str) -> bool:
    name = f"{family}.{op}.{case}"
    return impl == "ours" and any(name == s or name.startswith(s + ".") for s in planted_selectors())


def twice(fn: Callable[[], object]) -> Callable[[], object]:
    def slowed_down():
        fn()
        return fn()

    return slowed_down
