"""The kernels behind issue 20's two unexplained gaps, each run once between cudaProfilerStart and
cudaProfilerStop, for Nsight Compute (`ncu --profile-from-start off`; lease.sh stage `profile`):

  logprobs      one forward+backward of the fused token logprobs at N 4096, H 4096, V 8192 (one
                vocabulary chunk: each lm_head GEMM launches once), so the statistics GEMM (its softmax
                epilogue: 505 TFLOP/s on an H100) profiles beside the logit-grad GEMM (the same
                mainloop, a lighter epilogue: 680)
  lora_forward  the LoRA forward at 4096 x 14336, T 8192, r 16, fp32 adapters (x A, the packing, the
                extended-K GEMM: +12% over cuBLAS), then the bare base GEMM x W^T on cuBLAS

Warm-up calls run before the profiled range (first-call allocations, cuBLAS's heuristics).

    ncu --profile-from-start off --clock-control none --csv --page details \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python -m benchmarks.ncu_targets [--ops logprobs,lora_forward] > ncu.csv
    python -m benchmarks.ncu_summary ncu.csv
"""

from __future__ import annotations

import argparse
import os

import torch


def logprobs_calls():
    from pykernels.logprobs import token_logprobs

    n, h, v = 4096, 4096, 8192
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).bfloat16().requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda")

    def call():
        token_logprobs(hidden, weight, targets).sum().backward()

    return [call]


def lora_forward_calls():
    from pykernels import lora

    tokens, in_features, out_features, r = 8192, 4096, 14336, 16
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    dense = (torch.randn(out_features, in_features, device="cuda") * in_features**-0.5).bfloat16()
    a = torch.randn(r, in_features, device="cuda") * in_features**-0.5
    b = torch.randn(out_features, r, device="cuda") * 0.01

    def ours():
        with torch.no_grad():
            lora.lora_linear(x, dense, a, b, 2.0)

    def base():
        torch.nn.functional.linear(x, dense)

    return [ours, base]


OPS = {"logprobs": logprobs_calls, "lora_forward": lora_forward_calls}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops.split(",") if op not in OPS]
    if unknown:
        raise SystemExit(f"unknown op {', '.join(unknown)}: {', '.join(OPS)}")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_targets runs the CUDA kernels: it needs a GPU")
    os.environ["PYKERNELS_KERNELS"] = "ours"
    calls = [call for op in args.ops.split(",") for call in OPS[op]()]
    for call in calls:  # warm-up, outside the profiled range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
