"""What every GPU stage script shares (.ci/gpu/*.py, run by the Makefile's gpu-* targets): the
--dry-run switch (or DRY_RUN=1), the stage's wall-time line, running a command under the stage's time
limit, and one-line failures.

A dry run does everything up to the first CUDA call (argument parsing, file discovery, imports,
test collection) and prints the commands the real run would execute, so a mistake shows on a CPU
machine instead of on a GPU node leased by the minute.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = ROOT / "build"
# each stage must end inside 8 minutes on a 16-core H100 node; a lease's shorter limit for the stage
# (.ci/gpu/lease.sh sets GPU_STAGE_BUDGET_S) is kept by the stage itself, so it ends with its table and
# wall-time line instead of being killed by the lease's timeout
STAGE_BUDGET_S = float(os.environ.get("GPU_STAGE_BUDGET_S") or 480)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class StageError(Exception):
    """A failure the user can act on: printed as one message, no traceback."""


def parse_args(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", default=os.environ.get("DRY_RUN", "") not in ("", "0"),
                        help="check everything up to the first CUDA call and print the commands (also DRY_RUN=1)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def show(command: list[str], env: dict[str, str] | None = None) -> str:
    prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(command)


def run(command: list[str], *, dry_run: bool, timeout_s: float, env: dict[str, str] | None = None,
        capture: bool = False) -> subprocess.CompletedProcess | None:
    """Runs command in the repository root (or, in a dry run, only prints it) under timeout_s: the
    whole process group is killed when it runs over. Returns the finished process (None in a dry run)."""
    print(("would run: " if dry_run else "+ ") + show(command, env), flush=True)
    if dry_run:
        return None
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True,
                               stdout=subprocess.PIPE if capture else None, text=True)
    try:
        stdout, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise StageError(f"ran over its {timeout_s:.0f} s limit and was stopped: {show(command)}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, None)


def remaining(started: float) -> float:
    return max(1.0, STAGE_BUDGET_S - (time.monotonic() - started))


def main(stage: str, body, args: argparse.Namespace, budget_s: float | None = STAGE_BUDGET_S) -> int:
    """Runs body(args, started) as stage `stage`; prints its wall time whatever happens, and turns a
    StageError into one line on stderr and exit status 1. body returns the exit status."""
    started = time.monotonic()
    status = 1
    try:
        status = body(args, started)
    except StageError as error:
        print(f"{stage}: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{stage}: interrupted", file=sys.stderr)
        status = 130
    finally:
        wall = time.monotonic() - started
        verdict = "dry run ok" if args.dry_run and status == 0 else ("ok" if status == 0 else "FAILED")
        budget = f" (budget {budget_s:.0f} s)" if budget_s else ""
        print(f"{stage}: {verdict}, wall time {wall:.1f} s{budget}", flush=True)
    return status


def check_cuda_torch(dry_run: bool) -> str:
    """torch >= 2.9 built with CUDA (the extension is built against it), or a StageError. A dry run
    reports what the real run would refuse instead of failing. Makes no CUDA call."""
    try:
        import torch
    except ImportError:
        raise StageError("torch is not importable by this python "
                         f"({sys.executable}): the GPU stages build against the image's torch") from None
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    problem = None
    if (major, minor) < (2, 9):
        problem = f"needs torch >= 2.9, found {torch.__version__}"
    elif torch.version.cuda is None:
        problem = f"needs a CUDA build of torch, found {torch.__version__} (no CUDA)"
    if problem and not dry_run:
        raise StageError(problem)
    if problem:
        print(f"note: {problem}: the real run refuses here")
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}"
