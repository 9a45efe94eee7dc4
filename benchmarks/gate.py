"""Benchmark gate: fail when ours falls below a speedup floor against a baseline.

    python -m benchmarks.gate build/bench.json [--thresholds benchmarks/thresholds.toml]

Speedup = baseline time / ours time, per case, both the best round of the same run. Each rule
"<family>.<op>.<baseline>" in the section of the run's device class sets
  geomean  floor on the geometric mean of the speedups over all cases of that op (the regression
           guard: one noisy case cannot fail it, a 2x slowdown of ours halves it), and optionally
  each     floor every single case must meet (hard targets, e.g. "never slower than X").
A rule "<family>.<op>.<baseline>.peak_memory" compares the working memory the benchmark recorded
(extra_info["peak_extra_bytes"], baseline / ours) instead of the time. `cases = "text"` limits a
rule to the cases whose name contains text (a target stated for one size, e.g. "V151936"); a
list of such tables sets several floors on one rule (e.g. a regression guard at the small sizes
and the issue's target at the size it was stated for).
A rule with no measured case fails: a benchmark that silently stopped running must not pass.
Ratios, never absolute times: the machines are shared and noisy, two codes timed side by side are
affected alike.

With --remeasure, the cases of failing rules are timed once more (ours and the baseline side by
side, in a fresh process) and the gate judges the best of both runs. A burst of interference on a
shared machine hits one case of one run (CI, 2026-11-22: three gate runs of one tree failed on
three different single cases, every one of which passed in the other runs); a real regression
fails both runs.

`pytest --benchmark` runs the suite and this gate in one session, always re-measuring
(benchmarks/gate_plugin.py); this command judges a saved JSON file.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.results_file import Result, best_of, load_results

DEFAULT_THRESHOLDS = Path(__file__).with_name("thresholds.toml")


@dataclass(frozen=True)
class Floor:
    geomean: float
    each: float | None = None
    metric: str = "time"
    cases: str | None = None  # only cases whose name contains this


@dataclass(frozen=True)
class CaseRatio:
    case: str
    ours_s: float | None
    baseline_s: float | None

    @property
    def speedup(self) -> float | None:
        if self.ours_s is None or self.baseline_s is None:
            return None
        return self.baseline_s / self.ours_s


@dataclass(frozen=True)
class Check:
    rule: str
    floor: Floor
    cases: tuple[CaseRatio, ...]

    @property
    def label(self) -> str:
        """The rule, and the cases its floor is limited to."""
        return self.rule if self.floor.cases is None else f"{self.rule} [{self.floor.cases}]"

    @property
    def geomean(self) -> float | None:
        speedups = [c.speedup for c in self.cases]
        if not speedups or any(s is None for s in speedups):
            return None
        return math.exp(sum(math.log(s) for s in speedups) / len(speedups))

    def case_passed(self, case: CaseRatio) -> bool:
        return case.speedup is not None and (self.floor.each is None or case.speedup >= self.floor.each)

    @property
    def passed(self) -> bool:
        return (self.geomean is not None and self.geomean >= self.floor.geomean
                and all(self.case_passed(c) for c in self.cases))

    def cases_to_remeasure(self) -> list[str]:
        """A failed mean is every case's business; otherwise only the cases below `each`."""
        if self.geomean is not None and self.geomean < self.floor.geomean:
            return [c.case for c in self.cases]
        return [c.case for c in self.cases if not self.case_passed(c)]


def evaluate(results: list[Result], floors: dict[str, list[Floor]]) -> list[Check]:
    by_key = {(r.family, r.op, r.case, r.impl): r for r in results}
    checks = []
    for rule, floor in ((rule, floor) for rule, rule_floors in sorted(floors.items()) for floor in rule_floors):
        family, op, baseline = rule.removesuffix(".peak_memory").rsplit(".", 2)
        cases = sorted({r.case for r in results if (r.family, r.op) == (family, op)
                        and (floor.cases is None or floor.cases in r.case)})
        ratios = []
        for case in cases:
            ours = by_key.get((family, op, case, "ours"))
            base = by_key.get((family, op, case, baseline))
            ratios.append(CaseRatio(case, ours and ours.metric(floor.metric), base and base.metric(floor.metric)))
        checks.append(Check(rule, floor, tuple(ratios)))
    return checks


def scope(checks: list[Check], complete_families: set[str] | None) -> tuple[list[Check], list[Check]]:
    """(judged, not evaluated) for a run that timed part of the suite (pytest --benchmark -k nf4).

    complete_families None: the whole suite ran, or a saved file is judged: every rule is judged,
    and one with no measured case fails (a benchmark that silently stopped running must not pass).
    A rule of a family whose benchmark file ran whole is judged the same way. Any other rule is
    judged on the cases where both ours and its baseline ran, and is not evaluated without one.
    """
    if complete_families is None:
        return list(checks), []
    judged, not_evaluated = [], []
    for check in checks:
        if check.rule.split(".", 1)[0] in complete_families:
            judged.append(check)
            continue
        measured = tuple(c for c in check.cases if c.ours_s is not None and c.baseline_s is not None)
        if measured:
            judged.append(replace(check, cases=measured))
        else:
            not_evaluated.append(check)
    return judged, not_evaluated


def load_floors(path: Path, device_class: str) -> dict[str, list[Floor]]:
    thresholds = tomllib.loads(path.read_text())
    if device_class not in thresholds:
        raise SystemExit(f"gate: {path} has no [{device_class}] section; add floors for this device class")
    floors = {}
    for rule, values in thresholds[device_class].items():
        metric = "peak_memory" if rule.endswith(".peak_memory") else "time"
        floors[rule] = []
        for value in values if isinstance(values, list) and values else [values]:
            if isinstance(value, (int, float)):
                value = {"geomean": value}
            if rule.removesuffix(".peak_memory").count(".") != 2 or not isinstance(value, dict) \
                    or set(value) - {"geomean", "each", "cases"} \
                    or not isinstance(value.get("geomean"), (int, float)) \
                    or not isinstance(value.get("cases", ""), str):
                raise SystemExit(f"gate: {path} [{device_class}] {rule} = {values!r}: expected "
                                 "\"<family>.<op>.<baseline>[.peak_memory]\" = <geomean floor>, "
                                 "{ geomean = x, each = y, cases = \"text\" } or a list of such tables")
            floors[rule].append(Floor(float(value["geomean"]), None if "each" not in value else float(value["each"]),
                                      metric, value.get("cases")))
    return floors


def format_checks(checks: list[Check]) -> str:
    def ms(value, metric="time"):  # seconds as ms; bytes (peak_memory) as MiB
        if value is None:
            return "-"
        return f"{value * 1e3:.3f}" if metric == "time" else f"{value / 2**20:.0f} MiB"

    def ratio(value):
        return "-" if value is None else f"{value:.2f}x"

    width = max([44, *(len(check.label) for check in checks)])
    lines = [f"{'rule / case':<{width}} {'ours ms':>10} {'base ms':>10} {'speedup':>9} {'floor':>7}  result"]
    for check in checks:
        floor = check.floor
        verdict = "ok" if check.passed else ("MISSING" if check.geomean is None else "FAIL")
        lines.append(f"{check.label:<{width}} {'':>10} {'':>10} {ratio(check.geomean):>9} "
                     f"{ratio(floor.geomean):>7}  {verdict} (geometric mean of {len(check.cases)} cases)")
        for case in check.cases:
            verdict = "ok" if check.case_passed(case) else ("MISSING" if case.speedup is None else "FAIL")
            lines.append(f"  {case.case:<{width - 2}} {ms(case.ours_s, floor.metric):>10} "
                         f"{ms(case.baseline_s, floor.metric):>10} {ratio(case.speedup):>9} {ratio(floor.each):>7}  "
                         f"{verdict}")
        if not check.cases:
            lines.append("  (no results)")
    return "\n".join(lines)


def remeasure_tests(checks: list[Check], results: list[Result]) -> list[str]:
    """pytest node ids of ours and the baseline for every case a failed check would look at again."""
    wanted = set()
    for check in (c for c in checks if not c.passed):
        family, op, baseline = check.rule.removesuffix(".peak_memory").rsplit(".", 2)
        wanted |= {(family, op, case, impl) for case in check.cases_to_remeasure() for impl in ("ours", baseline)}
    return list(dict.fromkeys(r.test for r in results if r.key in wanted and r.test))


def run_benchmarks(tests: list[str], json_path: Path, cwd: Path | None = None) -> bool:
    """Time the given benchmark tests in a fresh pytest process (in cwd, the directory their node
    ids are relative to); True when it wrote its results."""
    json_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", *tests, "--benchmark-only", f"--benchmark-json={json_path}",
               "-q", "-p", "no:cacheprovider"]
    subprocess.run(command, check=False, cwd=cwd)
    return json_path.exists()


@dataclass
class Verdict:
    device_class: str
    checks: list[Check]  # judged on the first run
    not_evaluated: list[Check] = field(default_factory=list)  # see scope()
    retimed: list[str] = field(default_factory=list)  # node ids timed once more
    rechecks: list[Check] | None = None  # the failed rules on the best of both runs; None: not re-timed
    final: list[Check] | None = None  # every judged rule after re-timing; None: as first judged

    @property
    def failed(self) -> list[Check]:
        return [c for c in (self.checks if self.final is None else self.final) if not c.passed]


def judge(results: list[Result], floors: dict[str, list[Floor]], complete_families: set[str] | None = None,
          retime: Callable[[list[str]], list[Result] | None] | None = None) -> Verdict:
    """Judge one run; with retime, time the cases of failed rules once more (retime(node ids) ->
    their new results, None when none were written) and judge the best of both runs."""
    checks, not_evaluated = scope(evaluate(results, floors), complete_families)
    verdict = Verdict(results[0].device_class if results else "-", checks, not_evaluated)
    failed = verdict.failed
    verdict.retimed = remeasure_tests(failed, results) if retime else []
    again = retime(verdict.retimed) if verdict.retimed else None
    if again is not None:
        verdict.final, _ = scope(evaluate(best_of(results, again), floors), complete_families)
        retried = {c.rule for c in failed}
        verdict.rechecks = [c for c in verdict.final if c.rule in retried]
    return verdict


def format_verdict(verdict: Verdict) -> str:
    lines = [format_checks(verdict.checks)]
    if verdict.rechecks is not None:
        lines += [f"\nbenchmark gate [{verdict.device_class}], best of both runs for the re-measured rules",
                  format_checks(verdict.rechecks)]
    elif verdict.retimed:
        lines.append(f"\nre-measuring {len(verdict.retimed)} benchmark(s) wrote no results; judging the first run")
    if verdict.not_evaluated:
        rules = sorted({c.label for c in verdict.not_evaluated})
        lines.append(f"\nnot evaluated, none of their cases ran in this session ({len(rules)} rules):")
        row = ""
        for rule in rules:  # wrapped between rules, never inside one
            if row and len(row) + len(rule) > 96:
                lines.append(f"  {row},")
                row = ""
            row = f"{row}, {rule}" if row else rule
        lines.append(f"  {row}")
    judged = len(verdict.checks if verdict.final is None else verdict.final)
    lines.append(f"\n{judged - len(verdict.failed)}/{judged} rules passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="pytest-benchmark JSON (--benchmark-json)")
    parser.add_argument("--thresholds", type=Path, default=DEFAULT_THRESHOLDS)
    parser.add_argument("--remeasure", action="store_true",
                        help="time the cases of failing rules once more and judge the best of both runs")
    args = parser.parse_args(argv)

    if not args.results.exists():
        print(f"gate: {args.results} does not exist; run `pytest --benchmark "
              f"--benchmark-json={args.results}` first", file=sys.stderr)
        return 2
    results = load_results(args.results)
    classes = {r.device_class for r in results}
    if len(classes) != 1:
        print(f"gate: expected results from one device class, found {sorted(classes) or 'none'}", file=sys.stderr)
        return 2
    device_class = classes.pop()
    floors = load_floors(args.thresholds, device_class)
    again = args.results.with_suffix(".remeasured.json")

    def retime(tests: list[str]) -> list[Result] | None:
        print(f"benchmark gate [{device_class}]: rules failed; timing their {len(tests)} benchmark(s) once more, "
              "side by side")
        if run_benchmarks(tests, again):
            return load_results(again)
        print(f"gate: re-measuring wrote no {again}; judging the first run", file=sys.stderr)
        return None

    verdict = judge(results, floors, retime=retime if args.remeasure else None)
    print(f"benchmark gate [{device_class}] ({args.thresholds})")
    print(format_verdict(verdict))
    return 1 if verdict.failed else 0


if __name__ == "__main__":
    sys.exit(main())
