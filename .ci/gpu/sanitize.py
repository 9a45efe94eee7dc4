"""make gpu-sanitize: compute-sanitizer's memcheck and racecheck over sanitize_ops.py (every op
once, small shapes, our kernels forced). torch's caching allocator is off under memcheck so an
out-of-bounds access past a tensor's end is not hidden inside a pooled block.

    python .ci/gpu/sanitize.py [--dry-run]
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import stage

TOOLS = ("memcheck", "racecheck")
WORKLOAD = Path(__file__).with_name("sanitize_ops.py")
SANITIZER_ARGS = ["--error-exitcode", "1", "--report-api-errors", "no", "--print-limit", "20"]


def find_sanitizer() -> str | None:
    """compute-sanitizer from PATH, CUDA_HOME or the default CUDA install."""
    candidates = [shutil.which("compute-sanitizer")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "compute-sanitizer"))
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


def body(args, started: float) -> int:
    sanitizer = find_sanitizer()
    if sanitizer is None:
        message = "compute-sanitizer not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin (CUDA toolkit)"
        if not args.dry_run:
            raise stage.StageError(message)
        print(f"note: {message} (the real run stops here)")
        sanitizer = "compute-sanitizer"
    # The dry run runs the workload on the CPU: the op calls and their arguments are checked here.
    stage.run([sys.executable, str(WORKLOAD), "--device", "cpu"], dry_run=False, timeout_s=stage.remaining(started))
    env = {"PYKERNELS_KERNELS": "ours", "PYTHONUNBUFFERED": "1"}
    failed = []
    for tool in TOOLS:
        tool_env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"} if tool == "memcheck" else env
        command = [sanitizer, "--tool", tool, *SANITIZER_ARGS, sys.executable, str(WORKLOAD), "--device", "cuda"]
        result = stage.run(command, dry_run=args.dry_run, timeout_s=stage.remaining(started), env=tool_env)
        if result is not None and result.returncode != 0:
            failed.append(tool)
    if failed:
        raise stage.StageError(f"{' and '.join(failed)} reported errors (output above)")
    return 0


if __name__ == "__main__":
    args = stage.parse_args(__doc__)
    sys.exit(stage.main("gpu-sanitize", body, args))
