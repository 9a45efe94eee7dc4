"""make gpu-test: the CUDA tests (tests marked `cuda`, not the slow end-to-end tier) under the
stage's time limit. The CPU suite runs in CI, not here.

With pytest-xdist (in the wheel bundle) the tests run on WORKERS processes sharing the GPU, the
real-shape file after them on its own: its cases hold 10-17 GiB each, and 12 workers running them
at once ran out of the H100's 80 GiB (2026-11-27; 1081 tests in 129 s on 12 workers, over 150 s on 6,
over the 240 s lease limit in one process).

    python .ci/gpu/test.py [--dry-run] [--workers N] [pytest args ...]
"""

from __future__ import annotations

import importlib.util
import re
import sys

import stage

MARKER = "cuda and not slow"
SERIAL = ("tests/kernels/test_real_shapes_cuda.py",)  # tens of GiB a case: one at a time
WORKERS = 12


def cuda_test_files() -> list[str]:
    """Test files that mark tests `cuda` (collecting only these is quicker than all of tests/)."""
    files = [path for path in sorted((stage.ROOT / "tests").rglob("test_*.py")) if "mark.cuda" in path.read_text()]
    if not files:
        raise stage.StageError("no test file under tests/ marks tests with pytest.mark.cuda")
    return [str(path.relative_to(stage.ROOT)) for path in files]


def collected(output: str) -> int:
    """Tests pytest --collect-only -q selected ("877/3421 tests collected (...)" or "12 tests collected")."""
    match = re.search(r"^(\d+)(?:/\d+)? tests? collected", output, re.MULTILINE)
    return int(match.group(1)) if match else 0


def body(args, started: float) -> int:
    files = cuda_test_files()
    selection = [*files, "-m", MARKER]
    collect = [sys.executable, "-m", "pytest", *selection, "--collect-only", "-q", *args.pytest_args]
    result = stage.run(collect, dry_run=False, timeout_s=stage.remaining(started), capture=True)
    count = collected(result.stdout)
    if result.returncode != 0 or count == 0:
        print(result.stdout[-4000:])
        raise stage.StageError(f"the CUDA test selection (-m '{MARKER}') collected "
                               f"{count} tests (pytest exit {result.returncode})")
    print(f"CUDA tests selected: {count}")
    parallel = [f for f in files if f not in SERIAL]
    workers = ["-n", str(args.workers)] if args.workers > 1 and importlib.util.find_spec("xdist") else []
    status = 0
    for group, extra in ((parallel, workers), ([f for f in files if f in SERIAL], [])):
        if not group:
            continue
        command = [sys.executable, "-m", "pytest", *group, "-m", MARKER, "-q", "-p", "no:cacheprovider", *extra,
                   *args.pytest_args]
        result = stage.run(command, dry_run=args.dry_run, timeout_s=stage.remaining(started))
        if result is not None and result.returncode not in (0, 5):  # 5: nothing selected (a -k filter)
            status = result.returncode
    return status


def options(parser) -> None:
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help=f"pytest-xdist processes for all but {', '.join(SERIAL)} (1: one process)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k nf4 -x)")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-test", body, args))
