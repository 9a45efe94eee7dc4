"""Reading a pytest-benchmark JSON file written by this suite (see conftest.measure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
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

    def metric(self, name: str) -> float | None:
        """The value a gate rule compares: best time per call, or peak extra memory, counted as at
        least MEMORY_RESOLUTION (smaller needs may come out of resident heap and read as 0)."""
        if name == "time":
            return self.min_s
        return None if self.peak_extra_bytes is None else max(self.peak_extra_bytes, MEMORY_RESOLUTION)

    @property
    def rule_key(self) -> str:
        return f"{self.family}.{self.op}"


def load_results(path: str | Path) -> list[Result]:
    data = json.loads(Path(path).read_text())
    results = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if not {"family", "op", "case", "impl", "device_class"} <= info.keys():
            raise ValueError(f"{path}: benchmark {bench.get('name')} lacks family/op/case/impl labels "
                             "(was it timed through the `measure` fixture?)")
        repeats = info.get("repeats", 1)
        stats = bench["stats"]
        results.append(Result(info["family"], info["op"], info["case"], info["impl"], info["device_class"],
                              stats["min"] / repeats, stats["median"] / repeats, info.get("gbps"),
                              info.get("pct_peak"), info.get("tflops"), info.get("pct_peak_flops"),
                              info.get("peak_extra_bytes")))
    return results
