"""Times every tile of the Hopper kernels on the ops that run on them, in one process on one build:
the GEMM core's (PYKERNELS_SM90_TILE, common/sm90_tiles.h) on MoE and LoRA, the lm_head GEMMs'
(PYKERNELS_SM90_LOGPROBS_TILE, logprobs/logprobs_sm90.h) on logprobs, both ways of running the
LoRA forward (PYKERNELS_SM90_LORA, lora/lora_extended_k.h: one GEMM with the term as extra K, or
cuBLAS's base GEMM with the LoRA term as its C operand) and the backward's grad_x
(PYKERNELS_SM90_LORA_GRAD_X: cuBLAS's dy W plus the rank term, or one extra-K GEMM), the rank products
with fp32 adapters (PYKERNELS_LORA_RANK_GEMM, lora/lora_rank_pieces.h: bf16 pieces on tensor cores, or
SIMT fp32; r 16 and 64), the core's tile orders (PYKERNELS_SM90_RASTER, common/sm90_tile_order.h:
raster direction and swizzle, on MoE and the LoRA forward), the core's two kernels for a dense GEMM
(PYKERNELS_SM90_DENSE, common/sm90_dense_plain.h: the ptr-array kernel with one group, or CUTLASS's plain
one-problem kernel, also walking along N; on the LoRA forward's cases, where the MoE op's row runs grouped,
the same under each), both of the
experts' LoRA products (PYKERNELS_SM90_MOE_LORA, moe/moe.h: extra K of the base GEMM, or their own
GEMMs), both ways of reading the QLoRA forward's NF4 weight (PYKERNELS_SM90_NF4,
nf4/nf4_gemm_sm90.h: dequantized chunks for cuBLAS, or decoded in the GEMM's mainloop) and both NF4
dequantize kernels (PYKERNELS_NF4_DEQUANT, nf4/nf4.h: a warp per 1024 values with 16-byte loads,
or a thread per store unit; the benchmarks' shapes, in GB/s beside a copy and a zeroing of the same output) and the
QLoRA GEMMs' chunks of W (PYKERNELS_NF4_CHUNK_MIB, lora/nf4_chunks.h: grown until a chunk's GEMM fills
the GPU, or 16 MiB), both ways of running the experts' gated activation (PYKERNELS_SM90_MOE_ACT,
pykernels/ops/moe.py: its own pass after the gate_up GEMM, or in that GEMM's epilogue,
common/paired_rows.h; on the MoE cases), both ways of reading the experts' rows by token
(PYKERNELS_SM90_MOE_GATHER, moe/moe.h: a gather pass, or the GEMM's producer warp copying them; on the
MoE cases with the activation in the epilogue, where the gate_up GEMM gathers too), both tiles of the
experts' LoRA rank-r products (PYKERNELS_MOE_RANK_TILE, moe/moe.h: 128 x 128, or 128 x 32 for the rank
side; on the MoE cases with LoRA), and both folds of
the logprobs statistics epilogue (PYKERNELS_SM90_LOGPROBS_FOLD, logprobs/logprobs_sm90.h: on the running
max, or on a lazy reference). All are
read on every call, so a lent GPU measures them all without rebuilding (~3 minutes of a 15-minute
lease per build). For choosing the defaults and the core's `auto` rule; the timings that count stay
the benchmarks' (pytest --benchmark).

Each case is forward+backward, our kernels forced, CUDA-event median of ROUNDS rounds after warm-up
(a round: one call, or as many queued calls as fill ROUND_MS when one is shorter), every tile timed
back to back on the same tensors. MoE: Qwen3-30B-A3B's experts at T 512 / 4096 /
16384 and Mixtral's at T 512 / 4096, with and without LoRA r 16 on the experts (benchmarks/
test_bench_moe.py's modules). LoRA (and lora_grad_x): r 16 on 4096 x 14336 at T 8192, dense bf16
weight, fp32 adapters. logprobs: H 4096, V 151936 at N 4096 and 16384, trainable and frozen lm_head
(the statistics and dz GEMMs run on the tile; dh and dW on cuBLAS). LoRA forward (no backward:
issue 20's target is the forward's overhead over the bare base GEMM, <= 5% at r 16, T 8192): 4096 x
14336 and 4096 x 4096 at T 8192, r 16, fp32 and bf16 adapters, bf16 and NF4 weights, with the bare
base GEMM (torch's x W^T, the same under every setting) as the first row and the same product on the
Hopper core alone (the MoE op, one expert) as the second. QLoRA forward: NF4
(double-quantized, blocksize 64) 4096 x 14336 and 4096 x 4096 at T 1024 and 8192, r 16 fp32
adapters, after the bare bf16 base GEMM.

    python -m benchmarks.tile_sweep [--ops moe,lora,logprobs,logprobs_fold,lora_forward,lora_grad_x,lora_rank,
                                           raster,moe_lora,moe_act,moe_gather,moe_rank_tile,qlora_forward,
                                           nf4_dequant,nf4_chunks]
                                    [--tiles auto,128x128,128x256]
                                    [--logprobs-tiles 256x128,128x128]
                                    [--logprobs-folds running_max,lazy_max]
                                    [--lora-forwards extended_k,cublas,extended_k@128x128,extended_k@128x256]
                                    [--lora-grad-xs cublas,extended_k] [--lora-rank-gemms simt,tensor_core]
                                    [--rasters m1,m2,m4,m8,n1,n2,n4,n8]
                                    [--moe-loras extra_k,separate] [--moe-acts separate,epilogue]
                                    [--moe-gathers pass,mainloop] [--moe-rank-tiles wide,narrow]
                                    [--nf4-forwards dequantize,mainloop] [--nf4-dequants warps,units]
                                    [--nf4-chunks auto,16]
                                    [--rounds 10]
"""

from __future__ import annotations

import argparse
import os

import torch

from pykernels import _C
import math

from pykernels.dispatch import cuda_timer

TILES = ("auto", "128x128", "128x256")  # the first is the default (common/sm90_tiles.h)
LOGPROBS_TILES = ("256x128", "128x128")  # the first is the default (logprobs/logprobs_sm90.h)
# the first is the default (lora/lora_extended_k.h); extended_k runs on the core's tile (@: which)
LORA_FORWARDS = ("extended_k", "cublas", "extended_k@128x128", "extended_k@128x256")
LORA_GRAD_XS = ("cublas", "extended_k")  # the first is the default (lora/lora_extended_k.h)
LORA_RANK_GEMMS = ("tensor_core", "simt")  # the first is the default (lora/lora_rank_pieces.h)
RASTERS = ("m1", "m2", "m4", "m8", "n1", "n2", "n4", "n8")  # the first is the default (common/sm90_tile_order.h)
# the first is the default (common/sm90_dense_plain.h); plain@n1: walking along N, CUTLASS's own order for a
# dense GEMM of more row tiles than column tiles (the LoRA forward's 64 x 56 at 4096 x 14336)
DENSES = ("array", "plain", "plain@n1")
MOE_LORAS = ("extra_k", "separate")  # the first is the default (moe/moe.h)
MOE_ACTS = ("separate", "epilogue")  # the first is the default (pykernels/ops/moe.py)
MOE_GATHERS = ("pass", "mainloop")  # the first is the default (moe/moe.h)
MOE_RANK_TILES = ("wide", "narrow")  # the first is the default (moe/moe.h)
NF4_FORWARDS = ("dequantize", "mainloop")  # the first is the default (nf4/nf4_gemm_sm90.h)
NF4_DEQUANTS = ("warps", "units")  # the first is the default (nf4/nf4.h)
NF4_CHUNKS = ("auto", "16")  # the first is the default (lora/nf4_chunks.h)
LOGPROBS_FOLDS = ("running_max", "lazy_max")  # the first is the default (logprobs/logprobs_sm90.h)
ROUNDS = 10


def moe_cases(loras=(False, True)):
    from benchmarks.test_bench_moe import SHAPES, make_block, routed_tokens

    for shape, token_counts in (("qwen3-30b-a3b", (512, 4096, 16384)), ("mixtral", (512, 4096))):
        hidden, inter, _, top_k = SHAPES[shape]
        for lora in loras:
            block, config = make_block(shape, lora, torch.device("cuda"))
            config._experts_implementation = "pykernels"
            for tokens in token_counts:
                x, index, weights = routed_tokens(shape, tokens, torch.device("cuda"), requires_grad=True)

                def call(block=block, x=x, index=index, weights=weights):
                    x.grad = weights.grad = None
                    block.experts(x, index, weights).float().square().mean().backward()

                flops = 12 * tokens * top_k * hidden * inter  # dx only: frozen experts, LoRA not counted
                yield f"moe {shape} T{tokens} {'lora' if lora else 'base'}", call, flops
            del block


def moe_lora_cases():
    return moe_cases(loras=(True,))


def moe_epilogue_act_cases():
    """The MoE cases with the activation in the gate_up GEMM's epilogue (PYKERNELS_SM90_MOE_ACT=epilogue),
    whose gated GEMM is one of the two that gather in the mainloop (the other: grad_x of the down
    projection, in every case)."""
    os.environ["PYKERNELS_SM90_MOE_ACT"] = "epilogue"
    try:
        yield from moe_cases()
    finally:
        os.environ.pop("PYKERNELS_SM90_MOE_ACT")


def lora_cases():
    from benchmarks.kernel_breakdown import lora_case
    from benchmarks.test_bench_lora import SHAPES

    in_features, out_features = SHAPES["4096x14336"]
    yield "lora 4096x14336 T8192 r16", lora_case()["ours"], 6 * 8192 * in_features * out_features


def lora_rank_cases():
    """LoRA forward+backward on 4096 x 14336 at T 8192, fp32 adapters, r 16 and 64 (the H100 lost to
    PEFT at r 64 with the SIMT rank products: benchmarks/results/h100.md)."""
    from benchmarks.test_bench_lora import SHAPES, Layer

    in_features, out_features = SHAPES["4096x14336"]
    x = torch.randn(8192, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for r in (16, 64):
        layer = Layer(in_features, out_features, r, "bf16", torch.device("cuda"))
        yield (f"lora 4096x14336 T8192 r{r}", lambda layer=layer: layer.ours(x).sum().backward(),
               6 * 8192 * in_features * out_features)


def raster_cases():
    """The GEMM core's tile orders on what it runs largest: MoE forward+backward without LoRA, and
    the LoRA forward (one group of 64 x 56 tiles at 4096 x 14336, T 8192)."""
    yield from moe_cases(loras=(False,))
    yield from lora_forward_cases(shapes=("4096x14336",), bases=("bf16",))


def lora_forward_cases(shapes=("4096x14336", "4096x4096"), bases=("bf16", "nf4")):
    from benchmarks.test_bench_lora import SHAPES
    from pykernels import lora, nf4

    for shape in shapes:
        in_features, out_features = SHAPES[shape]
        x = torch.randn(8192, in_features, device="cuda", dtype=torch.bfloat16)
        dense = (torch.randn(out_features, in_features, device="cuda") * in_features**-0.5).bfloat16()
        a = torch.randn(16, in_features, device="cuda") * in_features**-0.5
        b = torch.randn(out_features, 16, device="cuda") * 0.01
        flops = 2 * 8192 * in_features * out_features  # the base GEMM's: the LoRA term rides on it
        yield f"base x W^T {shape} T8192 (reference)", lambda x=x, w=dense: torch.nn.functional.linear(x, w), flops
        yield f"base x W^T {shape} T8192 on the core", core_gemm(x, dense), flops
        if (grouped := grouped_mm_gemm(x, dense)) is not None:  # CUTLASS's ptr-array kernel, as torch runs it
            yield f"base x W^T {shape} T8192 on torch._grouped_mm, one group", grouped, flops
        for base in bases:
            weight = nf4.quantize(dense, 64, double_quant=True) if base == "nf4" else dense
            for adapters, (a_, b_) in (("fp32", (a, b)), ("bf16", (a.bfloat16(), b.bfloat16()))):
                def call(x=x, weight=weight, a=a_, b=b_):
                    with torch.no_grad():
                        lora.lora_linear(x, weight, a, b, 2.0)

                yield f"lora forward {shape} T8192 r16 {base} weight, {adapters} adapters", call, flops


def core_gemm(x: torch.Tensor, weight: torch.Tensor):
    """x W^T on the Hopper GEMM core alone (no LoRA term): the MoE op with one expert every token picks,
    x already in slot order (grouped_in: no gather), so the extended-K LoRA forward's time splits into
    the core's GEMM against cuBLAS's and what the LoRA term adds."""
    from pykernels import moe

    routing = moe.sort_tokens(torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device), 1)
    experts = weight.unsqueeze(0)

    def call():
        with torch.no_grad():
            moe.grouped_linear(x, experts, *routing, grouped_in=True, grouped_out=True)

    return call


def grouped_mm_gemm(x: torch.Tensor, weight: torch.Tensor):
    """x W^T as torch._grouped_mm's one group: its sm90 path is CUTLASS's ptr-array grouped GEMM on the tile the
    core's default picks here (128x256, 2x1 cluster), so beside cuBLAS's F.linear and the core it tells whether
    the core's gap to cuBLAS is the ptr-array kernel's (torch's as slow) or the core's own (torch's as fast).
    None where this torch has no _grouped_mm or will not run it."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    ends = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
    b = weight.unsqueeze(0).transpose(1, 2)  # [1, K, N], K-major: the layout torch's MoE calls pass

    def call():
        torch._grouped_mm(x, b, offs=ends)

    try:
        call()
    except RuntimeError as error:  # a reference torch will not run here: no row rather than a failed sweep
        print(f"(x W^T on torch._grouped_mm not timed: {str(error).splitlines()[0]})", flush=True)
        return None
    return call


def qlora_forward_cases():
    from benchmarks.test_bench_lora import SHAPES
    from pykernels import lora, nf4

    for shape in ("4096x14336", "4096x4096"):
        in_features, out_features = SHAPES[shape]
        dense = (torch.randn(out_features, in_features, device="cuda") * in_features**-0.5).bfloat16()
        weight = nf4.quantize(dense, 64, double_quant=True)
        a = torch.randn(16, in_features, device="cuda") * in_features**-0.5
        b = torch.randn(out_features, 16, device="cuda") * 0.01
        for tokens in (1024, 8192):
            x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
            flops = 2 * tokens * in_features * out_features
            yield (f"base x W^T {shape} T{tokens} bf16 (reference)",
                   lambda x=x, w=dense: torch.nn.functional.linear(x, w), flops)

            def call(x=x, weight=weight, a=a, b=b):
                with torch.no_grad():
                    lora.lora_linear(x, weight, a, b, 2.0)

            yield f"qlora forward {shape} T{tokens} r16", call, flops


def nf4_dequant_cases():
    from benchmarks.test_bench_nf4 import SHAPES, packed_bytes
    from pykernels import nf4

    for shape_name, shape in SHAPES.items():
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        weight = nf4.quantize(x, 64, double_quant=True)
        moved = x.numel() * 2 + packed_bytes(x.numel())  # the benchmarks' bytes: bf16 out, packed in
        out = torch.empty_like(x)
        yield (f"copy of the bf16 output {shape_name} (reference: bytes read + written)",
               lambda out=out, x=x: out.copy_(x), 2 * x.numel() * 2)
        # The dequantize writes 4 bytes for each it reads: whether writes alone reach the copy's rate says whether
        # issue 20's 85% of copy is this traffic's to reach (a memset: the card's write ceiling).
        yield (f"zeroing of the bf16 output {shape_name} (reference: bytes written)", out.zero_, x.numel() * 2)
        yield (f"nf4 dequantize {shape_name} bf16, blocksize 64, double-quantized",
               lambda w=weight: nf4.dequantize(w), moved)


def logprobs_cases():
    from pykernels.logprobs import token_logprobs

    h, v = 4096, 151936
    weight = (torch.randn(v, h, device="cuda") * h**-0.5).bfloat16()
    for n in (4096, 16384):
        hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, v, (n,), device="cuda")
        for trainable in (True, False):
            w = weight.clone().requires_grad_(trainable)

            def call(hidden=hidden, w=w, targets=targets):
                hidden.grad = w.grad = None
                token_logprobs(hidden, w, targets).sum().backward()

            flops = (8 if trainable else 6) * n * h * v  # the GEMMs we run: the backward recomputes the logits
            yield f"logprobs N{n} {'trainable' if trainable else 'frozen'}", call, flops


# op: (its cases, the variable that picks the tile, the tiles' argument)
CASES = {"moe": (moe_cases, "PYKERNELS_SM90_TILE", "tiles"), "lora": (lora_cases, "PYKERNELS_SM90_TILE", "tiles"),
         "logprobs": (logprobs_cases, "PYKERNELS_SM90_LOGPROBS_TILE", "logprobs_tiles"),
         "logprobs_fold": (logprobs_cases, "PYKERNELS_SM90_LOGPROBS_FOLD", "logprobs_folds"),
         "lora_forward": (lora_forward_cases, "PYKERNELS_SM90_LORA", "lora_forwards"),
         "lora_grad_x": (lora_cases, "PYKERNELS_SM90_LORA_GRAD_X", "lora_grad_xs"),
         "lora_rank": (lora_rank_cases, "PYKERNELS_LORA_RANK_GEMM", "lora_rank_gemms"),
         "raster": (raster_cases, "PYKERNELS_SM90_RASTER", "rasters"),
         "dense": (lora_forward_cases, "PYKERNELS_SM90_DENSE", "denses"),
         "moe_lora": (moe_lora_cases, "PYKERNELS_SM90_MOE_LORA", "moe_loras"),
         "moe_act": (moe_cases, "PYKERNELS_SM90_MOE_ACT", "moe_acts"),
         "moe_gather": (moe_epilogue_act_cases, "PYKERNELS_SM90_MOE_GATHER", "moe_gathers"),
         "moe_rank_tile": (moe_lora_cases, "PYKERNELS_MOE_RANK_TILE", "moe_rank_tiles"),
         "qlora_forward": (qlora_forward_cases, "PYKERNELS_SM90_NF4", "nf4_forwards"),
         "nf4_dequant": (nf4_dequant_cases, "PYKERNELS_NF4_DEQUANT", "nf4_dequants"),
         "nf4_chunks": (qlora_forward_cases, "PYKERNELS_NF4_CHUNK_MIB", "nf4_chunks")}
# What a case's third number counts, per op: FLOPs (the default, rated in TF/s) or bytes moved (GB/s);
# (label, work per ms per unit).
TFLOPS = ("TF/s", 1e9)
RATE_UNITS = {"nf4_dequant": ("GB/s", 1e6)}


ROUND_MS = 1.0  # GPU time a timed round covers at least


def per_call_ms(fn, rounds: int) -> float:
    """Median ms per call of fn over `rounds` rounds, each round as many back-to-back calls as fill
    ROUND_MS: a short kernel timed alone between two events also times the host's launch gap (the
    first sweep put a 17 us NF4 dequantize at 36 us), queued calls keep the GPU busy."""
    once = cuda_timer(fn, warmup=3, iters=1) * 1e3
    calls = max(1, math.ceil(ROUND_MS / max(once, 1e-3)))
    return cuda_timer(fn, warmup=0, iters=rounds, calls=calls) * 1e3


def sweep(cases, variable: str, tiles: list[str], rounds: int, unit: tuple[str, float] = TFLOPS) -> None:
    """Each case under each choice; a choice "value@tile" also sets the core's tile (PYKERNELS_SM90_TILE:
    the extended-K LoRA forward runs on the core), "value@order" its tile order (PYKERNELS_SM90_RASTER)."""
    for name, fn, flops in cases:
        times = {}
        for tile in tiles:
            value, _, core = tile.partition("@")
            core_variable = "PYKERNELS_SM90_RASTER" if core in RASTERS else "PYKERNELS_SM90_TILE"
            os.environ[variable] = value
            if core:
                os.environ[core_variable] = core
            times[tile] = per_call_ms(fn, rounds)
            if core:
                os.environ.pop(core_variable)
        os.environ.pop(variable)
        print(row_line(name, times, flops, tiles, unit), flush=True)


def header(tiles: list[str]) -> str:
    return ("| case | " + " | ".join(f"{t} ms" for t in tiles) + " | best | best vs " + tiles[0] + " |\n"
            + "|---" * (len(tiles) + 3) + "|")


def row_line(name: str, times: dict[str, float], work: int, tiles: list[str],
             unit: tuple[str, float] = TFLOPS) -> str:
    """A case's row: each choice's ms and rate (work per ms / unit[1], in unit[0]), the best choice."""
    best = min(times, key=times.get)
    label, per_ms = unit
    cells = [f"{times[t]:.3f} ({work / times[t] / per_ms:.0f} {label})" for t in tiles]
    return f"| {name} | " + " | ".join(cells) + f" | {best} | {times[tiles[0]] / times[best]:.2f}x |"


# Each choice argument (--kind-with-dashes): its default choices (the first, the baseline, is the
# default setting) and what they are the ways of.
CHOICE_ARGS = {"tiles": (TILES, "the GEMM core's tiles"),
               "logprobs_tiles": (LOGPROBS_TILES, "the lm_head GEMMs' tiles"),
               "logprobs_folds": (LOGPROBS_FOLDS, "the logprobs statistics epilogue's folds"),
               "lora_forwards": (LORA_FORWARDS, "the LoRA forward's ways"),
               "lora_grad_xs": (LORA_GRAD_XS, "the LoRA backward's ways of computing grad_x"),
               "lora_rank_gemms": (LORA_RANK_GEMMS, "the LoRA rank products' ways with fp32 factors"),
               "rasters": (RASTERS, "the GEMM core's tile orders"),
               "denses": (DENSES, "the GEMM core's kernels for a dense GEMM (the LoRA forward's)"),
               "moe_loras": (MOE_LORAS, "the experts' LoRA products' ways"),
               "moe_acts": (MOE_ACTS, "the experts' gated activation's ways"),
               "moe_gathers": (MOE_GATHERS, "the experts' ways of reading rows by token"),
               "moe_rank_tiles": (MOE_RANK_TILES, "the experts' LoRA rank products' tiles"),
               "nf4_forwards": (NF4_FORWARDS, "the QLoRA forward's ways of reading NF4"),
               "nf4_dequants": (NF4_DEQUANTS, "the NF4 dequantize's kernels"),
               "nf4_chunks": (NF4_CHUNKS, "the QLoRA GEMMs' chunks of NF4 W (MiB, or auto)")}


def known_choices() -> dict[str, list[str]]:
    """What each choice argument accepts: the build's own lists where it has them (a tile or order
    not compiled is refused), else the defaults."""
    known = {kind: list(defaults) for kind, (defaults, _) in CHOICE_ARGS.items()}
    known.update(tiles=["auto", *_C.host_logic.gemm_sm90_tiles], logprobs_tiles=_C.host_logic.logprobs_sm90_tiles,
                 rasters=_C.host_logic.gemm_sm90_tile_orders)
    return known


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(CASES))
    for kind, (defaults, what) in CHOICE_ARGS.items():
        parser.add_argument(f"--{kind.replace('_', '-')}", default=",".join(defaults),
                            help=f"{what}; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    ops = args.ops.split(",")
    if unknown := [op for op in ops if op not in CASES]:
        raise SystemExit(f"unknown op {', '.join(unknown)}: {', '.join(CASES)}")
    tiles = {kind: getattr(args, kind).split(",") for kind in CHOICE_ARGS}
    known = known_choices()
    for kind, names in tiles.items():
        if unknown := [t for t in names if t not in known[kind]]:
            raise SystemExit(f"unknown choice {', '.join(unknown)}: --{kind.replace('_', '-')} takes "
                             f"{', '.join(known[kind])}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("tile_sweep times the Hopper kernels: it needs a compute capability 9.0 GPU")
    os.environ["PYKERNELS_KERNELS"] = "ours"
    os.environ.pop("PYKERNELS_SM90", None)
    print(f"{torch.cuda.get_device_name()}: forward+backward, CUDA-event median per call of {args.rounds} rounds "
          f"(short calls queued {ROUND_MS} ms a round)", flush=True)
    for op in ops:
        cases, variable, kind = CASES[op]
        print(f"\n{op} ({variable})\n{header(tiles[kind])}", flush=True)
        sweep(cases(), variable, tiles[kind], args.rounds, RATE_UNITS.get(op, TFLOPS))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
