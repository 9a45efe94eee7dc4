"""benchmarks/kernel_breakdown.py runs only on a GPU; here its command line."""

import subprocess
import sys


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.kernel_breakdown", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--ops" in result.stdout and "PYKERNELS_SM90=0" in result.stdout

