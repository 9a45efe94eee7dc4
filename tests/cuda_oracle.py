"""The CUDA tests' check of every output against an fp64 oracle and the CPU ops (STYLE.md #6):
    max|cuda - fp64| <= 2 * max|torch_lowprec - fp64| + ulp * max|fp64|
                        + 4 * 2^-24 * sqrt(depth) * max|fp64|
and the CPU ops within twice that budget. An output whose oracle is None must come back empty.

The last term is fp32 accumulation over a reduction of `depth` terms: a kernel that sums each
output's products in one running fp32 sum (our SIMT and grouped kernels) errs like a random walk,
~sqrt(depth) half-ulps, while cuBLAS's fp32 GEMM sums in shorter pieces and errs several times less
(measured on an H100: LoRA y at K = 4096, ours 2.3e-5, cuBLAS's at most 2.8e-6). The term is
negligible beside a 16-bit dtype's own error and far below what a wrong index or tile costs."""

import math

FP32_HALF_ULP = 2.0**-24


def error_budget(exact, lowprec, ulp, depth=1):
    if exact.numel() == 0:
        return 0.0
    largest = exact.abs().max().item()
    return (2 * (lowprec.double() - exact).abs().max().item() + ulp * largest
            + 4 * FP32_HALF_ULP * math.sqrt(depth) * largest)


def check_outputs(cuda, cpu, exact, lowprec, names, ulp, depth=1):
    """cuda, cpu, exact, lowprec: dicts of the outputs by name; ulp: the slack per unit of |fp64|;
    depth: the longest reduction behind any of the outputs (error_budget)."""
    for name in names:
        got, want = cuda[name], cpu[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), \
            f"{name}: cuda {got.dtype} {tuple(got.shape)} != cpu {want.dtype} {tuple(want.shape)}"
        assert got.is_cuda, f"{name} is on {got.device}"
        if exact[name] is None:
            assert got.numel() == 0, f"{name} must be empty, got shape {tuple(got.shape)}"
            continue
        budget = error_budget(exact[name], lowprec[name], ulp, depth)
        err = (got.double() - exact[name]).abs().max().item() if got.numel() else 0.0
        assert err <= budget, f"{name}: max|cuda - fp64| = {err:.3e} > budget {budget:.3e}"
        gap = (got.double() - want.cuda().double()).abs().max().item() if got.numel() else 0.0
        assert gap <= 2 * budget, f"{name}: max|cuda - cpu| = {gap:.3e} > twice the budget {budget:.3e}"
