"""`pytest --benchmark`: the benchmark suite and its speedup gate (benchmarks/gate.py) in one session.

The root conftest.py registers this plugin only when --benchmark is given: plain `pytest` neither
collects a benchmark nor imports this module. Without paths on the command line the session
collects benchmarks/ instead of the testpaths; -k, -m and paths select a subset as usual. A last
item, `benchmark-gate`, judges what ran against benchmarks/thresholds.toml for the run's device
class, as `python -m benchmarks.gate --remeasure` judges a saved file:

- the cases of failing rules are timed once more in a fresh process and judged on the best of
  both runs (a burst of interference on a shared machine hits one run, a real regression both);
  PYKERNELS_BENCH_RETIME=0 judges the first run alone (a lent GPU's minutes: a failing LoRA rule
  re-timed every case of its op, and pytest-benchmark writes --benchmark-json only when the session
  ends, so a stage limit reached while re-timing loses the whole file);
- every rule of a benchmark file that ran whole is judged, and one without results fails; in a
  subset, a rule none of whose cases ran (ours and its baseline) is listed as not evaluated;
- the item fails, so the session exits 1, when a rule misses its floor; its message names the
  rules. The report (GB/s or TFLOP/s and % of peak per case) and the gate table are printed in
  the terminal summary.

pytest-benchmark's own options keep their meaning: --benchmark-json=PATH writes the first run's
results (its folder is created; the re-timed cases go to PATH with the suffix .remeasured.json);
--benchmark-only changes nothing here; --benchmark-skip and --benchmark-disable, and xdist (which
disables timing), are refused: the gate needs timings. pytest parses options without prefix
matching, so --benchmark never stands for one of pytest-benchmark's --benchmark-* options.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import gate, report
from benchmarks.results_file import Result, load_results, parse_benchmarks
from benchmarks.self_test import PLANT_ENV, planted_selectors

GATE_ITEM = "benchmark-gate"
RETIME_ENV = "PYKERNELS_BENCH_RETIME"  # "0": no second run of failing rules


def family_of(path: Path) -> str | None:
    """benchmarks/test_bench_<family>.py holds the benchmarks of <family> (STYLE.md item 8)."""
    if path.name.startswith("test_bench_") and path.suffix == ".py":
        return path.stem.removeprefix("test_bench_")
    return None


def release_cached_device_memory() -> None:
    """The re-timing process shares the GPU with this one, whose allocator still caches what the
    largest cases freed: on an H100 49 GiB after torch_materialized at V 151936, which left the
    re-timed run of that case out of memory. Nothing here on a CPU or before CUDA started."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def refuse_conflicting_options(config: pytest.Config) -> None:
    try:
        skip, only = config.getoption("benchmark_skip"), config.getoption("benchmark_only")
        disable, enable = config.getoption("benchmark_disable"), config.getoption("benchmark_enable")
    except ValueError:
        raise pytest.UsageError("--benchmark needs pytest-benchmark (pip install -e '.[bench]')") from None
    if skip and not only:
        raise pytest.UsageError("--benchmark times the benchmarks and gates them; --benchmark-skip skips them")
    if disable and not enable:
        raise pytest.UsageError("--benchmark times the benchmarks and gates them; --benchmark-disable runs them "
                                "untimed")
    if config.getoption("dist", "no") != "no" or config.getoption("numprocesses", None):
        raise pytest.UsageError("--benchmark cannot run under xdist (-n / --dist): pytest-benchmark disables "
                                "timing there")


class GateItem(pytest.Item):
    """The gate, run after every benchmark of the session."""

    def __init__(self, *, plugin: GatePlugin, **kwargs):
        super().__init__(**kwargs)
        self.plugin = plugin

    def runtest(self) -> None:
        self.plugin.run_gate(self.session)

    def reportinfo(self):
        return self.path, None, "benchmark gate"


def benchmark_json_path(config: pytest.Config) -> str | None:
    """--benchmark-json's path: pytest-benchmark 5.3 gives a Path, 5.2 (the CUDA images') opens the
    file while parsing options and gives the open file (its .name is the path as typed)."""
    value = config.getoption("benchmark_json")
    if value is None:
        return None
    return os.fspath(value) if isinstance(value, (str, os.PathLike)) else value.name


class GatePlugin:
    def __init__(self, config: pytest.Config):
        refuse_conflicting_options(config)
        first_json = benchmark_json_path(config)
        if first_json:  # pytest-benchmark writes it after the last benchmark, into an existing folder only
            Path(first_json).parent.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.suite_dir = config.rootpath / "benchmarks"
        self.thresholds = self.suite_dir / "thresholds.toml"
        self.deselected: set[Path] = set()  # files with an item left out by -k, -m, --deselect, --lf
        self.skipped_modules: set[Path] = set()  # benchmark files skipped whole at import
        self.complete_families: set[str] | None = None  # see gate.scope
        self.verdict: gate.Verdict | None = None
        self.problem: str | None = None  # why the gate could not judge
        if config.args_source != pytest.Config.ArgsSource.ARGS:  # no paths given: the suite, not testpaths
            config.args = [str(self.suite_dir)]
            config.args_source = pytest.Config.ArgsSource.ARGS

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped and "::" not in report.nodeid:
            self.skipped_modules.add(self.config.rootpath / report.nodeid)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected.update(item.path for item in items)

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, items: list[pytest.Item]):
        result = yield  # -k / -m selection and the suite's own ordering (benchmarks/conftest.py) first
        items.append(GateItem.from_parent(session, name=GATE_ITEM, nodeid=GATE_ITEM, plugin=self))
        return result

    def session_results(self) -> list[Result]:
        """What pytest-benchmark has timed so far: the benchmarks its session writes to --benchmark-json."""
        benchmarks = self.config._benchmarksession.benchmarks
        return parse_benchmarks([b.as_dict(include_data=False) for b in benchmarks if not b.has_error],
                                "this session")

    def fail(self, problem: str) -> None:
        self.problem = problem
        pytest.fail(problem, pytrace=False)

    def run_gate(self, session: pytest.Session) -> None:
        try:
            results = self.session_results()
        except ValueError as error:
            self.fail(str(error))
        if not results:
            self.fail("benchmark gate: no benchmark recorded a result in this session, nothing to judge")
        classes = sorted({r.device_class for r in results})
        if len(classes) != 1:
            self.fail(f"benchmark gate: expected results from one device class, found {classes}")
        try:
            floors = gate.load_floors(self.thresholds, classes[0])
        except SystemExit as error:  # a malformed or missing section: load_floors' message
            self.fail(str(error))
        self.complete_families = self.families_run_whole(session.items)
        retime = None if os.environ.get(RETIME_ENV) == "0" else self.retime
        self.verdict = gate.judge(results, floors, self.complete_families, retime=retime)
        if self.verdict.failed:
            pytest.fail(self.failure_message(), pytrace=False)
        if not self.verdict.checks:
            self.fail(f"benchmark gate [{classes[0]}]: no rule of {self.thresholds.name} has a case that ran "
                      "in this session, nothing was judged")

    def families_run_whole(self, items: list[pytest.Item]) -> set[str] | None:
        """Families whose benchmark file ran with nothing left out; None when every file of the suite did."""
        invocation = self.config.invocation_params.dir
        narrowed = {Path(os.path.abspath(invocation / arg.split("::")[0]))
                    for arg in self.config.args if "::" in arg}  # node ids: part of a file
        ran = {item.path for item in items if "benchmark" in getattr(item, "fixturenames", ())}
        whole = (ran | self.skipped_modules) - self.deselected - narrowed
        if set(self.suite_dir.glob("test_bench_*.py")) <= whole:
            return None
        return {family for family in map(family_of, whole) if family}

    def retime(self, tests: list[str]) -> list[Result] | None:
        """Time the given benchmarks once more in a fresh pytest process (its output is captured
        with this item's and shown when the gate fails)."""
        first_json = benchmark_json_path(self.config)
        release_cached_device_memory()
        with tempfile.TemporaryDirectory() as scratch:
            again = (Path(first_json).absolute().with_suffix(".remeasured.json") if first_json
                     else Path(scratch, "remeasured.json"))
            print(f"benchmark gate: rules failed; timing their {len(tests)} benchmark(s) once more, side by side")
            return load_results(again) if gate.run_benchmarks(tests, again, cwd=self.config.rootpath) else None

    def failure_message(self) -> str:
        verdict = self.verdict
        failed = verdict.failed
        rules = ", ".join(dict.fromkeys(c.label for c in failed))
        if verdict.rechecks is not None:
            when = "on the best of two runs"
        elif verdict.retimed:
            when = "(re-timing wrote no results: first run)"
        else:
            when = f"(first run alone: {RETIME_ENV}=0)"
        headline = (f"{rules} below the floor {when} (benchmark gate [{verdict.device_class}]: "
                    f"{len(failed)} of {len(verdict.checks)} rules failed)")
        lines = [headline, gate.format_checks(failed)]
        if planted_selectors():
            lines.append(self.plant_note())
        return "\n".join(lines)

    def plant_note(self) -> str:
        return (f"{PLANT_ENV}={os.environ[PLANT_ENV]}: ours does its work twice in the matching cases "
                "(the gate's self-test, benchmarks/self_test.py)")

    @pytest.hookimpl(trylast=True)  # after pytest-benchmark's own table, nearest the verdict line
    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        try:
            results = self.session_results()
        except ValueError:
            results = []
        if results:
            tr.section("benchmark report: best round, throughput and % of the device's peak")
            tr.write_line(report.table(results, markdown=False))
        if self.verdict is None and self.problem is None:
            return  # the gate did not run: --collect-only, -x after a failure, an interrupt
        tr.section(f"benchmark gate [{self.verdict.device_class if self.verdict else '-'}]")
        if planted_selectors():
            tr.write_line(self.plant_note(), yellow=True, bold=True)
        if self.verdict is not None:
            scope = ("the whole suite" if self.complete_families is None else "a subset (benchmark files run "
                     f"whole: {', '.join(sorted(self.complete_families)) or 'none'})")
            tr.write_line(f"floors: {self.thresholds.relative_to(self.config.rootpath)}; this session ran {scope}")
            *table, verdict_line = gate.format_verdict(self.verdict).split("\n")
            tr.write_line("\n".join(table))
            passed = bool(self.verdict.checks) and not self.verdict.failed
            tr.write_line(verdict_line, green=passed, red=not passed, bold=True)
        if self.problem is not None:
            tr.write_line(self.problem, red=True, bold=True)
