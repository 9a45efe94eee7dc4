"""One line per kernel from Nsight Compute's CSV details page (`ncu --csv --page details`, as lease.sh's
`profile` stage writes it for benchmarks/ncu_targets.py): its short name, duration, SM and memory
throughput, registers, achieved occupancy and warp cycles per issued instruction, whichever of those
the sections collected. Lines before the CSV header (the program's own output, ncu's ==PROF== notes)
are skipped.

    python -m benchmarks.ncu_summary ncu.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import OrderedDict

# (column label, the metric names ncu has used for it)
COLUMNS = [
    ("ms", ("Duration",)),
    ("SM %", ("Compute (SM) Throughput", "SM [%]")),
    ("mem %", ("Memory Throughput", "Memory [%]")),
    ("DRAM %", ("DRAM Throughput",)),
    ("regs", ("Registers Per Thread",)),
    ("occupancy %", ("Achieved Occupancy",)),
    ("cycles/issue", ("Warp Cycles Per Issued Instruction",)),
]
TO_MS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3}


# Words of a template kernel's name that tell its GEMMs apart (the name up to its first '<' does not).
MARKERS = ("GemmUniversal", "Sm90SoftmaxPartials", "LogitGrad", "ExtendedKArrayMainloop", "Pingpong", "Cooperative")


def short_name(kernel: str, width: int = 90) -> str:
    """The kernel's name up to its template arguments, with the MARKERS they contain."""
    base = kernel.removeprefix("void ").split("<", 1)[0].split("(", 1)[0]
    markers = [marker for marker in MARKERS if marker in kernel]
    return (base + "".join(f" [{marker}]" for marker in markers))[:width]


def value(unit: str, text: str, label: str) -> str:
    number = float(text.replace(",", ""))
    if label == "ms":
        number *= TO_MS.get(unit.strip(), 1.0)
        return f"{number:.3f}"
    return f"{number:.0f}" if label in ("regs",) else f"{number:.1f}"


def summarize(lines: list[str]) -> list[str]:
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        raise SystemExit("no ncu CSV in the input (was the program run under `ncu --csv --page details`?)")
    kernels: OrderedDict[str, dict] = OrderedDict()
    for row in csv.DictReader(lines[header:]):
        kernel = kernels.setdefault(row["ID"], {"name": short_name(row["Kernel Name"])})
        for label, names in COLUMNS:
            if row["Metric Name"] in names and label not in kernel:
                try:
                    kernel[label] = value(row.get("Metric Unit", ""), row["Metric Value"], label)
                except ValueError:
                    pass
    out = ["| kernel | " + " | ".join(label for label, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    out += ["| " + kernel["name"] + " | " + " | ".join(kernel.get(label, "-") for label, _ in COLUMNS) + " |"
            for kernel in kernels.values()]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu's CSV details page")
    args = parser.parse_args(argv)
    with open(args.csv, encoding="utf-8", errors="replace") as source:
        lines = source.read().splitlines()
    print("\n".join(summarize(lines)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
