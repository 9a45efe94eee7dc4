"""benchmarks/kernel_breakdown.py runs only on a GPU; here its command line and its cases' table."""

import subprocess
import sys

from benchmarks import kernel_breakdown


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.kernel_breakdown", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--ops" in result.stdout and "PYKERNELS_SM90=0" in result.stdout


def test_cases_are_the_ops_the_gate_lost_on():
    assert set(kernel_breakdown.CASES) == {"lora", "logprobs"}
