"""make gpu-test: the CUDA tests (tests marked `cuda`, not the slow end-to-end tier) under the
stage's time limit. The CPU suite runs in CI, not here.

    python .ci/gpu/test.py [--dry-run] [pytest args ...]
"""

from __future__ import annotations

import re
import sys

import stage

MARKER = "cuda and not slow"


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
    selection = [*cuda_test_files(), "-m", MARKER]
    collect = [sys.executable, "-m", "pytest", *selection, "--collect-only", "-q", *args.pytest_args]
    result = stage.run(collect, dry_run=False, timeout_s=stage.remaining(started), capture=True)
    count = collected(result.stdout)
    if result.returncode != 0 or count == 0:
        print(result.stdout[-4000:])
        raise stage.StageError(f"the CUDA test selection (-m '{MARKER}') collected "
                               f"{count} tests (pytest exit {result.returncode})")
    print(f"CUDA tests selected: {count}")
    command = [sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider", *args.pytest_args]
    result = stage.run(command, dry_run=args.dry_run, timeout_s=stage.remaining(started))
    return 0 if result is None else result.returncode


def options(parser) -> None:
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k nf4 -x)")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-test", body, args))
