"""Where an op's GPU time goes: torch.profiler's per-kernel CUDA time for one forward+backward of the
LoRA, logprobs and MoE ops (Qwen3-30B-A3B's experts bare and with LoRA r 16) at a size users train at,
and for the LoRA and QLoRA forwards alone (issue 20's forward targets: <= 5% over the bare base GEMM at
T 8192, >= 1.5x PEFT's QLoRA at T 1024), on the default path and with the Hopper GEMM core switched off
(PYKERNELS_SM90=0), beside the torch baseline the gate compares with. For choosing what to tune during a
short GPU lease (e.g. the core's tile, README "On a GPU machine"); the timings that count are the
benchmarks' (pytest --benchmark).

    python -m benchmarks.kernel_breakdown [--top 12] [--ops lora,lora_forward,qlora_forward,logprobs,moe,moe_lora]
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

ITERATIONS = 3


def lora_case():
    from benchmarks.test_bench_lora import SHAPES, Layer

    in_features, out_features = SHAPES["4096x14336"]
    layer = Layer(in_features, out_features, 16, "bf16", torch.device("cuda"))
    x = torch.randn(8192, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return {"ours": lambda: layer.ours(x).sum().backward(), "peft": lambda: layer.peft(x).sum().backward()}


def forward_case(base: str, tokens: int, baseline: str, device: str = "cuda", shape: str = "4096x14336"):
    """The LoRA forward (r 16, fp32 adapters, `shape` in x out) alone, beside `baseline`: the bare base
    GEMM (x W^T) or PEFT's layer (for NF4: bitsandbytes' dequantize, cuBLAS, the LoRA term)."""
    from benchmarks.test_bench_lora import SHAPES, Layer

    def case():
        in_features, out_features = SHAPES[shape]
        layer = Layer(in_features, out_features, 16, base, torch.device(device))
        x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
        other = layer.base_only if baseline == "base_matmul" else layer.peft

        def no_grad(fn):
            def call():
                with torch.no_grad():
                    fn(x)
            return call

        return {"ours": no_grad(layer.ours), baseline: no_grad(other)}

    return case


def logprobs_case():
    from benchmarks.test_bench_logprobs import torch_materialized
    from pykernels.logprobs import token_logprobs

    n, h, v = 16384, 4096, 151936
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).bfloat16().requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda")
    return {"ours": lambda: token_logprobs(hidden, weight, targets).sum().backward(),
            "torch_materialized": lambda: torch_materialized(hidden, weight, targets).sum().backward()}


def moe_case(lora: bool):
    """Qwen3-30B-A3B's experts at T 16384, frozen, with PEFT's LoRA r 16 on both projections or without."""

    def case():
        from benchmarks.test_bench_moe import make_block, routed_tokens

        block, config = make_block("qwen3-30b-a3b", lora=lora, device=torch.device("cuda"))
        x, index, weights = routed_tokens("qwen3-30b-a3b", 16384, torch.device("cuda"), requires_grad=True)

        def run(implementation: str):
            def call():
                config._experts_implementation = implementation
                block.experts(x, index, weights).float().square().mean().backward()
            return call

        return {"ours": run("pykernels"), "grouped_mm": run("grouped_mm")}

    return case


CASES = {"lora": lora_case, "lora_forward": forward_case("bf16", 8192, "base_matmul"),
         "qlora_forward": forward_case("nf4", 1024, "peft"), "logprobs": logprobs_case, "moe": moe_case(lora=False),
         "moe_lora": moe_case(lora=True)}


def breakdown(fn, top: int) -> str:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERATIONS):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / ITERATIONS / 1e3
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    lines = [f"  {total:8.3f} ms a call on the GPU, by kernel:"]
    lines += [f"  {e.self_device_time_total / ITERATIONS / 1e3:8.3f} ms  x{e.count // ITERATIONS:<3d} {e.key[:110]}"
              for e in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--ops", default=",".join(CASES))
    args = parser.parse_args()
    os.environ["PYKERNELS_KERNELS"] = "ours"
    for op in args.ops.split(","):
        impls = CASES[op]()
        for impl, fn in impls.items():
            generations = ("1", "0") if impl == "ours" else ("1",)
            for sm90 in generations:
                os.environ["PYKERNELS_SM90"] = sm90
                label = f"{op} {impl}" + ("" if impl != "ours" else " (Hopper core)" if sm90 == "1" else " (sm80)")
                print(f"{label}:\n{breakdown(fn, args.top)}", flush=True)
        del impls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
