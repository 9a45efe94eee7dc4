"""Shared benchmark machinery: device choice, peak bandwidth, and timing with extra_info.

Every case times ours and its baselines in the same run and records, in extra_info:
family, op, case, impl, device_class, bytes per call, GB/s and % of the device's peak bandwidth.
benchmarks/gate.py reads those to compare speedups against per-device floors (`pytest --benchmark`
runs both: benchmarks/gate_plugin.py).
"""

from __future__ import annotations

import ctypes
import os
import functools
import sys
import time
from dataclasses import dataclass

import pytest
import torch

import pykernels
from benchmarks.self_test import is_planted, twice
from pykernels import backend

# "ours" times our kernels. Under the default `auto`, a GPU's first call per shape picks the faster
# side, so "ours" could time torch's path instead: on an H100 the LoRA rows labelled ours were
# torch's (6.0 ms; our kernels 14.9 ms by benchmarks/kernel_breakdown.py). PYKERNELS_KERNELS set in
# the environment still wins (e.g. =auto to time what users get by default).
if not os.environ.get(backend.ENV_VAR):
    backend.set_kernels("ours")


def pin_fresh_allocations() -> None:
    """Make every CPU allocation of 1 MiB or more a fresh mmap, for every implementation alike.

    glibc's default threshold is dynamic: a freed 32 MiB buffer may be recycled on the next call
    (no page faults) in one run and mapped afresh (one fault per 4 KiB) in another, which moved a
    baseline's time 10x between runs. Pinned, each call pays first-touch cost, as it does by
    default for any tensor over 32 MiB.
    """
    if sys.platform.startswith("linux"):
        M_MMAP_THRESHOLD = -3
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)


pin_fresh_allocations()

# Families whose timings hinge on page faults of fresh outputs run first. Our NF4 dequantize asks
# for transparent huge pages; with THP defrag "madvise" (the common default) each huge-page fault
# in a fragmented process waits for compaction, and after the logprobs baselines had allocated and
# freed gigabytes a 32 MiB dequantize took 19 ms instead of 3 ms (CI, 2026-11-22).
RUN_FIRST = ("test_bench_nf4.py",)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.path.name not in RUN_FIRST)  # stable: order within a file kept

# Published HBM bandwidth (bytes/s) and dense bf16 tensor-core throughput (FLOP/s) by device
# name; anything else uses a measured copy / a measured large bf16 matmul.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12}
PEAK_BF16_FLOPS = {"H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12}
TARGET_SECONDS_PER_CASE = 1.0  # total timed wall time per benchmark, split into rounds
# The suite's budget (the CPU logprobs cases take 1-17 s a call): calls this long are timed twice,
# the best of two absorbing one disturbed call. On the CPU the warm call that sized the rounds (or
# the caller's timed memory probe) is one of the two: the same call, timed the same way, one call
# fewer per case (~40 s of the suite). On a GPU calls of HEAVY_SECONDS or more get one round. A
# failing rule is re-timed in a fresh process before it fails.
SLOW_CALL_SECONDS = 1.0
HEAVY_SECONDS = 5.0


def bench_device() -> torch.device:
    """CUDA when present (GPU numbers are what matter there), else CPU; PYKERNELS_BENCH_DEVICE overrides."""
    name = os.environ.get("PYKERNELS_BENCH_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


AVX512_CPU_CLASSES = ("cpu", "cpu-zen4", "cpu-avx512", "cpu-amx")  # the same cases; each has its own floors
# CPUs without AVX-512: torch's bf16 GEMMs have no vector path there, so smaller cases (the same in both
# classes; each has its own floors).
NARROW_CPU_CLASSES = ("cpu-scalar", "cpu-avx2")
# The CI machines' classes (Zen 4, Intel Xeons without AVX-512 BF16, and those with AMX): there the runs
# no rule of benchmarks/thresholds.toml reads are left out (the MoE forward without LoRA, grouped_mm's
# MoE forward+backward without LoRA, chunked torch's logprobs forward: ~25 s of CI on Zen 4). Every
# other class times them: their rows fill the results pages.
RULES_ONLY_CLASSES = ("cpu-zen4", "cpu-avx512", "cpu-amx")


@functools.cache
def _rule_keys(device_class: str) -> list[tuple[str, str, str]]:
    """(family, op, baseline) of each of device_class's floors (benchmarks/gate.py reads them)."""
    from benchmarks.gate import DEFAULT_THRESHOLDS, load_floors

    return [tuple(rule.removesuffix(".peak_memory").rsplit(".", 2))
            for rule in load_floors(DEFAULT_THRESHOLDS, device_class)]


def read_by_a_rule(family: str, op: str, impl: str, device_class: str) -> bool:
    """Whether a run of `impl` on `op` feeds a rule of device_class's floors (ours feeds every rule of
    its op; a baseline, the rules named after it), or the class times every run anyway."""
    if device_class not in RULES_ONLY_CLASSES:
        return True
    return any(f == family and o == op and impl in ("ours", baseline) for f, o, baseline in _rule_keys(device_class))


def cpu_family() -> tuple[str, int]:
    """(vendor_id, cpu family) of /proc/cpuinfo's first processor; ("", 0) where there is none."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    family = fields.get("cpu family", "0")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def device_class(device: torch.device) -> str:
    """The thresholds section that judges a run on `device`, and the case set it times.

    CPUs split in three. Without AVX-512 (NARROW_CPU_CLASSES) torch's own bf16 GEMM runs ~20 GFLOP/s
    on 2 cores, so the cases are smaller, to keep the suite within CI's minutes: "cpu-avx2" (AVX2, FMA
    and F16C: AMD Zen 1-3 such as CI's EPYC, Intel client cores), where our NF4 dequantize and gated
    activation take their AVX2 kernels and the rest its portable code, and "cpu-scalar" (the portable
    code alone: other architectures, older x86). The AVX-512 (BF16) ones split by how wide their vector units
    are, which decides how close torch's oneDNN GEMMs come to the peak that ours reaches: "cpu-zen4"
    (AMD family 0x19: 512-bit instructions on 256-bit units, where oneDNN's bf16 GEMM runs at
    ~85% of the peak and a GEMM-bound op of ours can win only that gap) and "cpu" (AMD Zen 5 and the
    rest: full 512-bit units, where oneDNN ran at 55-85% of what ours reaches). "cpu-avx512" is AVX-512
    without its BF16 instructions (Intel Xeons before Sapphire Rapids: a CI machine since 2026-11-27),
    where neither side has a bf16 dot product: ours widens to fp32 FMAs, torch's bf16 GEMMs slow down
    more. "cpu-amx" is where our kernels' bf16 GEMMs run on AMX tiles (cpu isa "amx": Intel Sapphire
    Rapids and later, a CI machine since 2026-11-28), as torch's oneDNN GEMMs do. Same cases (without
    the N=4096 logprobs case, a CI-time cost), own floors. (A CPU with AMX whose tiles Linux refuses
    runs neither side on them: "cpu".)
    """
    if device.type == "cpu":
        isa = pykernels.build_info()["cpu_isa_detected"]
        if isa in ("scalar", "avx2"):
            return f"cpu-{isa}"
        if isa == "amx":
            return "cpu-amx"
        if cpu_family() == ("AuthenticAMD", 0x19):
            return "cpu-zen4"
        return "cpu" if "avx512_bf16" in cpu_flags() else "cpu-avx512"
    name = torch.cuda.get_device_name(device)
    for known in ("H200", "H100"):
        if known in name:
            return known.lower()
    return "cuda"


def run_device_class() -> str:
    """device_class of this session's bench_device(): what the benchmark files parametrize on."""
    return device_class(bench_device())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_copy_bandwidth(device: torch.device) -> float:
    """Read+write bytes/s of a large device-to-device copy into a preallocated buffer."""
    n = 64 * 2**20 if device.type == "cpu" else 512 * 2**20
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def measured_matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of torch's own large matmul: the practical peak on a machine without a spec sheet."""
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        a @ a
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_extra_memory(fn, device: torch.device, output_bytes: int = 0) -> int | None:
    """Working memory of fn: its peak allocation above what was allocated when it started, less
    output_bytes (what it must return: outputs and gradients, the same for every implementation).
    The CUDA allocator's peak on a GPU; on CPU this process's peak resident set (reset through
    /proc/self/clear_refs; allocations of 1 MiB or more are fresh mmaps, see pin_fresh_allocations,
    so freed memory leaves the resident set). None where neither is available."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before - output_bytes)
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM (peak RSS) to the current RSS
        before = _resident_bytes("VmRSS")
        fn()
        return max(0, _resident_bytes("VmHWM") - before - output_bytes)
    except OSError:
        return None


@dataclass
class Device:
    torch_device: torch.device
    device_class: str
    peak_bandwidth: float  # bytes/s
    peak_source: str
    peak_flops: float  # bf16 FLOP/s (fp32 on NARROW_CPU_CLASSES)
    flops_source: str


@pytest.fixture(scope="session")
def device() -> Device:
    dev = bench_device()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        for key, peak in PEAK_BANDWIDTH.items():
            if key in name:
                return Device(dev, device_class(dev), peak, f"published ({name})", PEAK_BF16_FLOPS[key],
                              f"published bf16 dense ({name})")
    klass = device_class(dev)
    # Without AVX-512 torch's bf16 a @ a crawls (~0.3 GFLOP/s, 3 minutes) and ours runs fp32 GEMMs.
    dtype, label = (torch.float32, "fp32") if klass in NARROW_CPU_CLASSES else (torch.bfloat16, "bf16")
    return Device(dev, klass, measured_copy_bandwidth(dev), "measured copy", measured_matmul_flops(dev, dtype),
                  f"measured torch {label} matmul")


def round_plan(seconds_per_call: float, device_type: str) -> tuple[int, int, bool]:
    """(calls per round, rounds to run, whether the timed sizing call counts as one more round) for a
    call of seconds_per_call (SLOW_CALL_SECONDS above)."""
    once = max(seconds_per_call, 1e-7)
    # On a GPU a single launch is too short to time with a wall clock: repeat inside one call.
    repeats = 1 if device_type == "cpu" else max(1, int(2e-3 / once))
    call_seconds = once * repeats
    if device_type == "cpu" and call_seconds >= SLOW_CALL_SECONDS:
        return repeats, 1, True
    if call_seconds >= HEAVY_SECONDS:
        return repeats, 1, False
    if call_seconds >= SLOW_CALL_SECONDS:
        return repeats, 2, False
    return repeats, max(3, min(50, int(TARGET_SECONDS_PER_CASE / call_seconds))), False


@pytest.fixture
def measure(benchmark, device):
    """measure(fn, bytes_moved=..., flops=..., family=..., op=..., case=..., impl=...) times fn and
    records extra_info: GB/s and % of peak bandwidth for memory-bound ops (bytes_moved), TFLOP/s
    and % of peak bf16 throughput for compute-bound ones (flops), and peak_extra_bytes when given
    (measured by the caller with peak_extra_memory). warmed_up: the caller already ran fn;
    seconds_per_call: and timed one warm call (e.g. its memory probe), which spares the sizing call.
    No warm-up round: the calls before the rounds warmed fn up."""

    def run(fn, bytes_moved: int = 0, flops: float = 0.0, peak_extra_bytes: int | None = None,
            warmed_up: bool = False, seconds_per_call: float | None = None, **labels: str) -> None:
        dev = device.torch_device
        planted = is_planted(labels["family"], labels["op"], labels["case"], labels["impl"])
        if planted:  # the gate's self-test (benchmarks/self_test.py): ours does its work twice
            fn = twice(fn)
        if not warmed_up:
            fn()  # warm-up: first-call allocations, lazy init
            synchronize(dev)
        if seconds_per_call is None or planted:  # one warm call, timed, to size the rounds
            start = time.perf_counter()
            fn()
            synchronize(dev)
            seconds_per_call = time.perf_counter() - start
        repeats, rounds, sizing_counts = round_plan(seconds_per_call, dev.type)
        counted = seconds_per_call if sizing_counts else None

        def timed():
            for _ in range(repeats):
                fn()
            synchronize(dev)

        benchmark.group = f"{labels['family']}.{labels['op']}.{labels['case']}"
        benchmark.extra_info.update(labels, device_class=device.device_class, repeats=repeats,
                                    bytes_per_call=bytes_moved, peak_bandwidth=device.peak_bandwidth,
                                    peak_source=device.peak_source, peak_flops_source=device.flops_source)
        if peak_extra_bytes is not None:
            benchmark.extra_info["peak_extra_bytes"] = peak_extra_bytes
        if planted:
            benchmark.extra_info["planted_slowdown"] = 2
        benchmark.pedantic(timed, rounds=rounds, iterations=1, warmup_rounds=0)
        if benchmark.stats is not None and counted is not None:
            benchmark.stats.stats.update(counted)  # how pytest-benchmark records a round; read below
        if benchmark.stats is not None:
            seconds = benchmark.stats.stats.min / repeats  # best round: interference only adds time
            if bytes_moved:
                benchmark.extra_info["gbps"] = bytes_moved / seconds / 1e9
                benchmark.extra_info["pct_peak"] = 100 * bytes_moved / seconds / device.peak_bandwidth
            if flops:
                benchmark.extra_info["tflops"] = flops / seconds / 1e12
                benchmark.extra_info["pct_peak_flops"] = 100 * flops / seconds / device.peak_flops

    return run
