"""Reading a pytest-benchmark JSON file written by this suite (see conftest.measure)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

MEMORY_RESOLUTION = 2**20  # bytes: allocations below glibc's pinned mmap threshold (benchmarks/conftest.py)


@dataclass(frozen=True)
class Result:
    family: str
    op: str
    case: str
    impl: str
    device_class: str
    min_s: float  # best round, per call: interference on a shared machine only ever adds time
    median_s: float  # per call
    gbps: float | None
    pct_peak: float | None  # of the device's bandwidth
    tflops: float | None = None
    pct_peak_flops: float | None = None  # of the device's bf16 throughput
    peak_extra_bytes: float | None = None  # memory the call needed beyond its inputs
    test: str | None = None  # pytest node id that measured it, to measure it again

    def metric(self, name: str) -> float | None:
        """The value a gate rule compares: best time per call, or peak extra memory, counted as at
        least MEMORY_RESOLUTION (smaller needs may come out of resident heap and read as 0)."""
        if name == "time":
            return self.min_s
        return None if self.peak_extra_bytes is None else max(self.peak_extra_bytes, MEMORY_RESOLUTION)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return self.family, self.op, self.case, self.impl


def load_results(path: str | Path) -> list[Result]:
    return parse_benchmarks(json.loads(Path(path).read_text()).get("benchmarks", []), str(path))


def parse_benchmarks(benchmarks: list[dict], source: str) -> list[Result]:
    """Results from pytest-benchmark's per-benchmark dicts: the "benchmarks" list of its JSON, or
    as_dict() of the benchmarks of a running session (benchmarks/gate_plugin.py)."""
    results = []
    for bench in benchmarks:
        info = bench.get("extra_info", {})
        if not {"family", "op", "case", "impl", "device_class"} <= info.keys():
            raise ValueError(f"{source}: benchmark {bench.get('name')} lacks family/op/case/impl labels "
                             "(was it timed through the `measure` fixture?)")
        repeats = info.get("repeats", 1)
        stats = bench["stats"]
        results.append(Result(info["family"], info["op"], info["case"], info["impl"], info["device_class"],
                              stats["min"] / repeats, stats["median"] / repeats, info.get("gbps"),
                              info.get("pct_peak"), info.get("tflops"), info.get("pct_peak_flops"),
                              info.get("peak_extra_bytes"), bench.get("fullname")))
    return results


def best_of(first: list[Result], second: list[Result]) -> list[Result]:
    """Each measurement of `first` merged with its repeat in `second` (same family, op, case and
    impl): the best time and the smallest memory of the two runs. Interference only ever adds."""
    again = {r.key: r for r in second}

    def merged(a: Result, b: Result | None) -> Result:
        if b is None:
            return a
        memory = [m for m in (a.peak_extra_bytes, b.peak_extra_bytes) if m is not None]
        return replace(a, min_s=min(a.min_s, b.min_s), median_s=min(a.median_s, b.median_s),
                       peak_extra_bytes=min(memory) if memory else None)

    return [merged(r, again.get(r.key)) for r in first]
