"""Throughput table of a benchmark run: per case, each implementation's time, GB/s and % of peak
(GB/s and speedups use the best round).

    python -m benchmarks.report build/bench.json [--markdown]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.results_file import load_results


def table(path: Path, markdown: bool) -> str:
    results = sorted(load_results(path), key=lambda r: (r.family, r.op, r.case, r.impl != "ours", r.min_s))
    ours = {(r.family, r.op, r.case): r.min_s for r in results if r.impl == "ours"}
    header = ["op", "case", "impl", "best ms", "median ms", "GB/s", "% peak", "ours vs impl"]
    rows = []
    for r in results:
        speedup = ours.get((r.family, r.op, r.case))
        rows.append([
            f"{r.family}.{r.op}", r.case, r.impl, f"{r.min_s * 1e3:.3f}", f"{r.median_s * 1e3:.3f}",
            "-" if r.gbps is None else f"{r.gbps:.1f}",
            "-" if r.pct_peak is None else f"{r.pct_peak:.1f}",
            "-" if speedup is None or r.impl == "ours" else f"{r.min_s / speedup:.2f}x",
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
    print(table(args.results, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
