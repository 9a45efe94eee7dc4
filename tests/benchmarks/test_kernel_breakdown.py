"""benchmarks/kernel_breakdown.py runs only on a GPU; here its command line."""

import subprocess
import sys

import pytest


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.kernel_breakdown", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--ops" in result.stdout and "PYKERNELS_SM90=0" in result.stdout


@pytest.mark.parametrize("base, baseline", [("bf16", "base_matmul"), ("nf4", "peft")])
def test_the_forward_cases_build_and_run(base, baseline):
    """The forward-only cases (the LoRA forward beside the bare base GEMM, the QLoRA one beside PEFT's
    bitsandbytes layer) on the CPU, a few tokens: what the GPU stage profiles runs."""
    from benchmarks.kernel_breakdown import forward_case

    calls = forward_case(base, 3, baseline, device="cpu", shape="2048x768")()
    assert list(calls) == ["ours", baseline]
    for call in calls.values():
        call()
