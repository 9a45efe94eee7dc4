"""Times every tile of the Hopper GEMM core (common/sm90_tiles.h) on the ops that run on it, in one
process on one build: PYKERNELS_SM90_TILE is read on every call, so a lent GPU measures them all
without rebuilding (~2 minutes of a 15-minute lease per build). For choosing the default tile and the
`auto` rule; the timings that count stay the benchmarks' (pytest --benchmark).

Each case is forward+backward, our kernels forced, CUDA-event median of ROUNDS calls after warm-up,
every tile timed back to back on the same tensors. MoE: Qwen3-30B-A3B's experts at T 512 / 4096 /
16384 and Mixtral's at T 512 / 4096, with and without LoRA r 16 on the experts (benchmarks/
test_bench_moe.py's modules). LoRA: r 16 on 4096 x 14336 at T 8192 (only its rank-r products run on
the core; its base GEMMs are cuBLAS's).

    python -m benchmarks.tile_sweep [--ops moe,lora] [--tiles 128x128,128x256,64x128,auto] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from pykernels import _C

TILES = ("128x128", "128x256", "64x128", "auto")  # the first is the default (common/sm90_tiles.h)
ROUNDS = 10


def moe_cases():
    from benchmarks.test_bench_moe import SHAPES, make_block

    for shape, token_counts in (("qwen3-30b-a3b", (512, 4096, 16384)), ("mixtral", (512, 4096))):
        hidden, inter, num_experts, top_k = SHAPES[shape]
        for lora in (False, True):
            block, config = make_block(shape, lora, torch.device("cuda"))
            config._experts_implementation = "pykernels"
            for tokens in token_counts:
                gen = torch.Generator(device="cuda").manual_seed(1)
                x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16().requires_grad_(True)
                logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
                weights, index = logits.softmax(-1).topk(top_k, dim=-1)
                weights = weights.bfloat16().requires_grad_(True)

                def call(block=block, x=x, index=index, weights=weights):
                    x.grad = weights.grad = None
                    block.experts(x, index, weights).float().square().mean().backward()

                flops = 12 * tokens * top_k * hidden * inter  # dx only: frozen experts, LoRA not counted
                yield f"moe {shape} T{tokens} {'lora' if lora else 'base'}", call, flops
            del block


def lora_cases():
    from benchmarks.test_bench_lora import SHAPES, Layer

    in_features, out_features = SHAPES["4096x14336"]
    layer = Layer(in_features, out_features, 16, "bf16", torch.device("cuda"))
    x = torch.randn(8192, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def call():
        x.grad = layer.a.grad = layer.b.grad = None
        layer.ours(x).sum().backward()

    yield "lora 4096x14336 T8192 r16", call, 6 * 8192 * in_features * out_features


CASES = {"moe": moe_cases, "lora": lora_cases}


def median_ms(fn, rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep(cases, tiles: list[str], rounds: int) -> list[tuple[str, dict[str, float], int]]:
    rows = []
    for name, fn, flops in cases:
        times = {}
        for tile in tiles:
            os.environ["PYKERNELS_SM90_TILE"] = tile
            times[tile] = median_ms(fn, rounds)
        os.environ.pop("PYKERNELS_SM90_TILE")
        rows.append((name, times, flops))
        print(row_line(name, times, flops, tiles), flush=True)
    return rows


def header(tiles: list[str]) -> str:
    return ("| case | " + " | ".join(f"{t} ms" for t in tiles) + " | best | best vs " + tiles[0] + " |\n"
            + "|---" * (len(tiles) + 3) + "|")


def row_line(name: str, times: dict[str, float], flops: int, tiles: list[str]) -> str:
    best = min(times, key=times.get)
    cells = [f"{times[t]:.3f} ({flops / times[t] / 1e9:.0f} TF/s)" for t in tiles]
    return f"| {name} | " + " | ".join(cells) + f" | {best} | {times[tiles[0]] / times[best]:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(CASES))
    parser.add_argument("--tiles", default=",".join(TILES), help="the first is the baseline of the last column")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    tiles = args.tiles.split(",")
    known = [*_C.host_logic.gemm_sm90_tiles, "auto"]
    if unknown := [t for t in tiles if t not in known]:
        raise SystemExit(f"unknown tile {', '.join(unknown)}: the core's tiles are {', '.join(known)}")
    if unknown := [op for op in args.ops.split(",") if op not in CASES]:
        raise SystemExit(f"unknown op {', '.join(unknown)}: {', '.join(CASES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("tile_sweep times the Hopper GEMM core: it needs a compute capability 9.0 GPU")
    os.environ["PYKERNELS_KERNELS"] = "ours"
    os.environ.pop("PYKERNELS_SM90", None)
    print(f"{torch.cuda.get_device_name()}: forward+backward, CUDA-event median of {args.rounds} calls\n")
    print(header(tiles), flush=True)
    for op in args.ops.split(","):
        sweep(CASES[op](), tiles, args.rounds)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
