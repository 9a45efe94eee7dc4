"""`pytest --benchmark` (benchmarks/gate_plugin.py) on a toy suite with a fake clock: the session's
verdict, exit status and tables, subsets, the re-measure in a fresh process, and plain pytest.

Each test builds a small project (the repository's root conftest.py, benchmarks/test_bench_toy.py,
benchmarks/thresholds.toml) and runs pytest on it in-process. The toy benchmarks advance a fake
clock by a fixed cost per call, so every ratio is exact: ours 1 s, the baseline "lib" 4 s.
"""

from pathlib import Path

import pytest

from benchmarks.gate_plugin import RETIME_ENV
from benchmarks.self_test import PLANT_ENV, is_planted

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

TOY_BENCH = '''
import os
from pathlib import Path

import pytest

from benchmarks.self_test import is_planted, twice

CLOCK = [0.0]
COST = {"ours": 1.0, "lib": 4.0}  # fake seconds per call


def clock():
    return CLOCK[0]


@pytest.mark.benchmark(timer=clock)
@pytest.mark.parametrize("impl", list(COST))
@pytest.mark.parametrize("case", ["small", "large"])
@pytest.mark.parametrize("op", ["scale", "shift"])
def test_toy(benchmark, op, case, impl):
    cost = COST[impl]
    once = os.environ.get("TOY_INTERFERENCE_ONCE")  # ours 3x slower on one case, first process only
    if once and impl == "ours" and (op, case) == ("scale", "small") and not Path(once).exists():
        Path(once).touch()
        cost *= 3

    def call():
        CLOCK[0] += cost

    if is_planted("toy", op, case, impl):
        call = twice(call)
    benchmark.extra_info.update(family="toy", op=op, case=case, impl=impl, device_class="cpu")
    benchmark.pedantic(call, rounds=2)
'''

THRESHOLDS = '''[cpu]
"toy.scale.lib" = { geomean = 3.0, each = 2.0 }
"toy.shift.lib" = 3.0
'''


@pytest.fixture
def toy(pytester, monkeypatch):
    monkeypatch.delenv(PLANT_ENV, raising=False)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)  # the inner session is no xdist worker (make test-fast runs -n 2)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the re-measure's fresh process imports benchmarks.self_test
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    suite = pytester.mkdir("benchmarks")
    (suite / "test_bench_toy.py").write_text(TOY_BENCH)
    (suite / "thresholds.toml").write_text(THRESHOLDS)
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_unit.py").write_text("def test_one():\n    pass\n")
    return pytester


def run(toy, *args):
    return toy.runpytest("--benchmark", "-p", "no:cacheprovider", *args)


def test_healthy_suite_passes_with_report_and_gate_in_the_summary(toy):
    result = run(toy)
    result.assert_outcomes(passed=9)  # 8 benchmarks (not tests/) and the gate
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "*benchmark report: best round*",
        "*benchmark gate [[]cpu[]]*",
        "*this session ran the whole suite",
        "toy.scale.lib * 4.00x   3.00x  ok (geometric mean of 2 cases)",
        "2/2 rules passed",
    ])
    assert "not evaluated" not in result.stdout.str()


def test_planted_2x_slowdown_fails_the_session_naming_the_rule_after_timing_it_again(toy, monkeypatch):
    monkeypatch.setenv(PLANT_ENV, "toy.scale")
    result = run(toy)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=8, failed=1)
    result.stdout.fnmatch_lines([
        "toy.scale.lib below the floor on the best of two runs (benchmark gate [[]cpu[]]: 1 of 2 rules failed)",
        "toy.scale.lib * 2.00x   3.00x  FAIL (geometric mean of 2 cases)",
        f"{PLANT_ENV}=toy.scale: ours does its work twice*",
        "*timing their 4 benchmark(s) once more*",  # captured output of the fresh process
        "*= benchmark gate [[]cpu[]] =*",
        f"{PLANT_ENV}=toy.scale: ours does its work twice*",
        "toy.scale.lib * 2.00x   3.00x  FAIL (geometric mean of 2 cases)",
        "*best of both runs for the re-measured rules",
        "toy.scale.lib * 2.00x   3.00x  FAIL (geometric mean of 2 cases)",
        "1/2 rules passed",
        "FAILED benchmark-gate - Failed: toy.scale.lib below the floor*",
    ])


def test_without_retime_a_failing_rule_is_judged_on_the_first_run(toy, monkeypatch):
    monkeypatch.setenv(PLANT_ENV, "toy.scale")
    monkeypatch.setenv(RETIME_ENV, "0")
    result = run(toy)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["toy.scale.lib below the floor (first run alone: PYKERNELS_BENCH_RETIME=0)*",
                                 "toy.scale.lib * 2.00x   3.00x  FAIL (geometric mean of 2 cases)"])
    assert "once more" not in result.stdout.str()


def test_interference_in_one_run_passes_on_the_best_of_two(toy, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_INTERFERENCE_ONCE", str(tmp_path / "interfered"))
    result = run(toy)
    assert result.ret == 0
    result.stdout.fnmatch_lines([
        "  small * 3000.000 * 1.33x   2.00x  FAIL",  # first run
        "*best of both runs for the re-measured rules",
        "toy.scale.lib * 4.00x   3.00x  ok (geometric mean of 2 cases)",
        "2/2 rules passed",
    ])


def test_failure_without_results_from_the_second_run_judges_the_first(toy, monkeypatch):
    from benchmarks import gate

    monkeypatch.setenv(PLANT_ENV, "toy")
    monkeypatch.setattr(gate, "run_benchmarks", lambda tests, json_path, cwd=None: False)
    result = run(toy)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    headline = ("toy.scale.lib, toy.shift.lib below the floor (re-timing wrote no results: first run) "
                "(benchmark gate [[]cpu[]]: 2 of 2 rules failed)")
    result.stdout.fnmatch_lines([headline])


def test_subset_judges_only_the_rules_whose_cases_ran(toy):
    result = run(toy, "-k", "scale")
    assert result.ret == 0
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines([
        "*this session ran a subset (benchmark files run whole: none)",
        "toy.scale.lib * ok (geometric mean of 2 cases)",
        "not evaluated, none of their cases ran in this session (1 rules):",
        "  toy.shift.lib",
        "1/1 rules passed",
    ])


def test_subset_with_only_one_side_of_a_case_judges_the_cases_where_both_ran(toy):
    result = run(toy, "-k", "scale and (lib or small)")  # ours ran for "small" only
    assert result.ret == 0
    result.stdout.fnmatch_lines(["toy.scale.lib * ok (geometric mean of 1 cases)"])


def test_subset_that_judges_nothing_fails(toy):
    result = run(toy, "-k", "ours")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*no rule of thresholds.toml has a case that ran in this session*"])


def test_file_run_whole_is_strict_other_files_are_not_evaluated(toy):
    (toy.path / "benchmarks" / "test_bench_other.py").write_text(
        TOY_BENCH.replace('family="toy"', 'family="other"'))
    with (toy.path / "benchmarks" / "thresholds.toml").open("a") as thresholds:
        thresholds.write('"other.scale.lib" = 3.0\n"toy.gone.lib" = 1.0\n')
    result = run(toy, "benchmarks/test_bench_toy.py")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # a rule of a file that ran whole has no results
    result.stdout.fnmatch_lines([
        "*this session ran a subset (benchmark files run whole: toy)",
        "toy.gone.lib * MISSING (geometric mean of 0 cases)",
        "  (no results)",
        "  other.scale.lib",
        "2/3 rules passed",
    ])


def test_benchmark_json_is_written_and_judged_by_the_standalone_gate(toy):
    result = run(toy, "--benchmark-json=build/bench.json")
    assert result.ret == 0
    from benchmarks import gate

    thresholds = toy.path / "benchmarks" / "thresholds.toml"
    assert gate.main([str(toy.path / "build" / "bench.json"), "--thresholds", str(thresholds)]) == 0


@pytest.mark.parametrize("option", ["--benchmark-skip", "--benchmark-disable"])
def test_options_that_stop_timing_are_refused(toy, option):
    result = run(toy, option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--benchmark times the benchmarks and gates them*"])


def test_plain_pytest_collects_no_benchmark_and_registers_no_gate(toy):
    result = toy.runpytest("--co", "-q")
    result.stdout.fnmatch_lines(["tests/test_unit.py::test_one", "1 test collected*"])
    assert toy.parseconfigure().pluginmanager.get_plugin("benchmark-gate") is None
    assert toy.parseconfigure("--benchmark").pluginmanager.get_plugin("benchmark-gate") is not None


def test_plant_selector_matches_family_op_or_case_of_ours_only(monkeypatch):
    monkeypatch.setenv(PLANT_ENV, "nf4.dequantize, lora.forward_bf16.2048x768-T1024-r16")
    assert is_planted("nf4", "dequantize", "4096x4096", "ours")
    assert not is_planted("nf4", "dequantize", "4096x4096", "bitsandbytes")
    assert not is_planted("nf4", "quantize", "4096x4096", "ours")
    assert is_planted("lora", "forward_bf16", "2048x768-T1024-r16", "ours")
    assert not is_planted("lora", "forward_bf16", "4096x4096-T1024-r16", "ours")
    monkeypatch.setenv(PLANT_ENV, "nf4.dequant")  # a selector ends at a dot: no partial names
    assert not is_planted("nf4", "dequantize", "4096x4096", "ours")
    monkeypatch.delenv(PLANT_ENV)
    assert not is_planted("nf4", "dequantize", "4096x4096", "ours")


@pytest.mark.parametrize("form", ["path", "str", "open file", "absent"])
def test_benchmark_json_path_from_either_pytest_benchmark(tmp_path, form):
    """--benchmark-json is a Path in pytest-benchmark 5.3 and an open file in 5.2 (the CUDA images'
    version, where the gate once crashed reading it as a path)."""
    from types import SimpleNamespace

    from benchmarks.gate_plugin import benchmark_json_path

    target = tmp_path / "out" / "bench.json"
    target.parent.mkdir()
    if form == "open file":
        value = open(target, "wb")  # noqa: SIM115 - what pytest-benchmark 5.2 hands over
    else:
        value = {"path": target, "str": str(target), "absent": None}[form]
    config = SimpleNamespace(getoption=lambda name: value if name == "benchmark_json" else None)
    try:
        assert benchmark_json_path(config) == (None if form == "absent" else str(target))
    finally:
        if form == "open file":
            value.close()
