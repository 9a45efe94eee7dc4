"""make gpu-bench: the benchmark suite and its gate on the GPU (pytest --benchmark), then the report
as Markdown in benchmarks/results/<device>.md (h100, h200, ...) with the commands that made it. The
report is written even when the gate fails; the stage then fails too.

    python .ci/gpu/bench.py [--dry-run] [pytest args ...]
"""

from __future__ import annotations

import datetime
import re
import sys

import stage

RESULTS_DIR = stage.ROOT / "benchmarks" / "results"


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200'; else the name as a slug."""
    for token in name.lower().replace("-", " ").split():
        if re.fullmatch(r"[a-z]\d{2,4}[a-z]?", token):
            return token
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


def results_page(device_name: str, versions: str, commands: list[str], table: str, gate_status: int) -> str:
    gate = "passed" if gate_status == 0 else f"FAILED (pytest exit {gate_status})"
    return "\n".join([
        f"# {device_name}", "",
        f"Written by `make gpu-bench` on {datetime.date.today().isoformat()}: {versions}. Gate: {gate}.", "",
        "Commands:", "", "```bash", *commands, "```", "", table, ""])


def body(args, started: float) -> int:
    versions = stage.check_cuda_torch(args.dry_run)
    collect = [sys.executable, "-m", "pytest", "--benchmark", "--collect-only", "-q", *args.pytest_args]
    result = stage.run(collect, dry_run=False, timeout_s=stage.remaining(started), capture=True)
    if result.returncode != 0:
        print(result.stdout[-4000:])
        raise stage.StageError(f"the benchmarks do not collect (pytest exit {result.returncode})")
    print(f"benchmarks selected: {len([line for line in result.stdout.splitlines() if '::' in line])}")
    if args.dry_run:
        device_name, device = "<torch.cuda.get_device_name()>", "DEVICE"
    else:
        import torch

        device_name = torch.cuda.get_device_name(0)
        device = device_slug(device_name)
    json_path = stage.BUILD_DIR / f"bench-{device}.json"
    page = RESULTS_DIR / f"{device}.md"
    bench = [sys.executable, "-m", "pytest", "--benchmark", f"--benchmark-json={json_path}", "-q",
             *args.pytest_args]
    report = [sys.executable, "-m", "benchmarks.report", str(json_path), "--markdown"]
    stage.BUILD_DIR.mkdir(exist_ok=True)
    gate = stage.run(bench, dry_run=args.dry_run, timeout_s=stage.remaining(started))
    table = stage.run(report, dry_run=args.dry_run, timeout_s=stage.remaining(started), capture=True)
    print(f"{'would write' if args.dry_run else 'writing'} {page.relative_to(stage.ROOT)}")
    if args.dry_run:
        return 0
    if table.returncode != 0:
        raise stage.StageError(f"benchmarks.report could not read {json_path} (output above)")
    shown = [stage.show(["python", *command[1:]]).replace(str(stage.ROOT) + "/", "") for command in (bench, report)]
    page.write_text(results_page(device_name, versions, shown, table.stdout.strip(), gate.returncode))
    return gate.returncode


def options(parser) -> None:
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k nf4)")


if __name__ == "__main__":
    args = stage.parse_args(__doc__, extra=options)
    sys.exit(stage.main("gpu-bench", body, args))
