"""Table of a benchmark run: per case, each implementation's time, throughput (GB/s or TFLOP/s,
with % of the device's peak), speedup of ours, and overhead over the base matmul where one was
timed (LoRA). Speedups and throughput use the best round.

    python -m benchmarks.report build/bench.json [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.results_file import Result, load_results

BASE_IMPL = "base_matmul"


def throughput(r: Result) -> str:
    if r.tflops is not None:
        return f"{r.tflops:.2f} TFLOP/s ({r.pct_peak_flops:.0f}%)"
    if r.gbps is not None:
        return f"{r.gbps:.1f} GB/s ({r.pct_peak:.0f}%)"
    return "-"


def base_op(op: str) -> str:
    """LoRA ops are timed per base (forward_bf16, forward_nf4); the base matmul only once (bf16)."""
    return op.rsplit("_", 1)[0] + "_bf16" if op.endswith("_nf4") else op


def table(results: list[Result], markdown: bool) -> str:
    results = sorted(results, key=lambda r: (r.family, r.op, r.case, r.impl != "ours", r.min_s))
    ours = {(r.family, r.op, r.case): r.min_s for r in results if r.impl == "ours"}
    bases = {(r.family, r.op, r.case): r.min_s for r in results if r.impl == BASE_IMPL}
    header = ["op", "case", "impl", "best ms", "median ms", "throughput (% peak)", "ours vs impl", "over base",
              "peak extra"]
    rows = []
    for r in results:
        speedup = ours.get((r.family, r.op, r.case))
        base = bases.get((r.family, base_op(r.op), r.case))
        rows.append([
            f"{r.family}.{r.op}", r.case, r.impl, f"{r.min_s * 1e3:.3f}", f"{r.median_s * 1e3:.3f}", throughput(r),
            "-" if speedup is None or r.impl == "ours" else f"{r.min_s / speedup:.2f}x",
            "-" if base is None or r.impl == BASE_IMPL else f"{100 * (r.min_s / base - 1):+.1f}%",
            "-" if r.peak_extra_bytes is None else f"{r.peak_extra_bytes / 2**20:.0f} MiB",
        ])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in [header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--markdown", action="store_true", help="emit a Markdown table (for benchmarks/results/)")
    args = parser.parse_args(argv)
    print(table(load_results(args.results), args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
