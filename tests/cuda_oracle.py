"""The CUDA tests' check of every output against an fp64 oracle and the CPU ops (STYLE.md #6):
    max|cuda - fp64| <= 2 * max|torch_lowprec - fp64| + ulp * max|fp64|
and the CPU ops within twice that budget. An output whose oracle is None must come back empty."""


def error_budget(exact, lowprec, ulp):
    if exact.numel() == 0:
        return 0.0
    return 2 * (lowprec.double() - exact).abs().max().item() + ulp * exact.abs().max().item()


def check_outputs(cuda, cpu, exact, lowprec, names, ulp):
    """cuda, cpu, exact, lowprec: dicts of the outputs by name; ulp: the slack per unit of |fp64|."""
    for name in names:
        got, want = cuda[name], cpu[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), \
            f"{name}: cuda {got.dtype} {tuple(got.shape)} != cpu {want.dtype} {tuple(want.shape)}"
        assert got.is_cuda, f"{name} is on {got.device}"
        if exact[name] is None:
            assert got.numel() == 0, f"{name} must be empty, got shape {tuple(got.shape)}"
            continue
        budget = error_budget(exact[name], lowprec[name], ulp)
        err = (got.double() - exact[name]).abs().max().item() if got.numel() else 0.0
        assert err <= budget, f"{name}: max|cuda - fp64| = {err:.3e} > budget {budget:.3e}"
        gap = (got.double() - want.cuda().double()).abs().max().item() if got.numel() else 0.0
        assert gap <= 2 * budget, f"{name}: max|cuda - cpu| = {gap:.3e} > twice the budget {budget:.3e}"
