"""The workload gpu-sanitize runs under compute-sanitizer: every public op once, forward and backward, on
small odd shapes, with our kernels forced (PYKERNELS_KERNELS=ours); and once more on sizes whose bf16
GEMMs a Hopper GPU runs on the sm_90a core (multiples of 8: csrc/common/gemm_sm90_torch.h), MoE with
LoRA on its experts and a dropped assignment, GPT-OSS' expert layout, and the logprobs backward of a
frozen lm_head over two token chunks; the MoE calls then run again on each tile of the Hopper GEMM core
forced (PYKERNELS_SM90_TILE, csrc/common/sm90_tiles.h; the default picks by shape), the logprobs calls
on the lm_head GEMMs' other tile (PYKERNELS_SM90_LOGPROBS_TILE, csrc/logprobs/logprobs_sm90.h: 128x128)
and with the statistics folded on a lazy reference
(PYKERNELS_SM90_LOGPROBS_FOLD=lazy_max), the LoRA calls with the forward on cuBLAS
(PYKERNELS_SM90_LORA=cublas), with grad_x as one extended-K GEMM (PYKERNELS_SM90_LORA_GRAD_X=extended_k,
csrc/lora/lora_extended_k.h), with the rank products as SIMT fp32 (PYKERNELS_LORA_RANK_GEMM=simt,
csrc/lora/lora_rank_pieces.h) and with the NF4 weight decoded in the GEMM's mainloop
(PYKERNELS_SM90_NF4=mainloop, csrc/nf4/nf4_gemm_sm90.h), and the MoE calls with the experts' LoRA
products as their own GEMMs (PYKERNELS_SM90_MOE_LORA=separate, csrc/moe/moe.h) and with the gated
activation in the gate_up GEMM's epilogue (PYKERNELS_SM90_MOE_ACT=epilogue, on intermediate sizes the
gated GEMM takes on each tile: csrc/common/paired_rows.h) and with the LoRA rank products on the narrow
tile (PYKERNELS_MOE_RANK_TILE=narrow, csrc/moe/moe.h), and the NF4 calls with
the dequantize by store units (PYKERNELS_NF4_DEQUANT=units, csrc/nf4/nf4.h; the default, by warp chunks,
stages codes in shared memory: racecheck's case).
On CPU (the dry run) the same calls check that this script still matches the ops' signatures.

    python .ci/gpu/sanitize_ops.py [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import stage  # noqa: F401  (puts the repository root on sys.path)
import torch

import pykernels.backend
import pykernels.logprobs as logprobs
import pykernels.lora as lora
import pykernels.moe as moe
import pykernels.nf4 as nf4
from pykernels import _C

DTYPE = torch.bfloat16


def randn(*shape: int, device: str, grad: bool = False) -> torch.Tensor:
    """Made on the CPU and copied, so the sanitizer sees no random-number kernels."""
    return (torch.randn(*shape, generator=GENERATOR) * 0.1).to(device, DTYPE).requires_grad_(grad)


GENERATOR = torch.Generator().manual_seed(0)


def run_nf4(device: str) -> None:
    weight = randn(83, 64, device=device)
    for double_quant in (False, True):
        packed = nf4.quantize(weight, 64, double_quant=double_quant)
        for dtype in (torch.float32, torch.bfloat16):  # 4 and 8 values per 16-byte store
            assert nf4.dequantize(packed, dtype).shape == weight.shape
            nf4.dequantize(packed, out=torch.empty(weight.shape, dtype=dtype, device=device))


def run_lora(device: str) -> None:
    for out_features in (83, 96):  # 96: the base GEMMs on the Hopper core
        x, a, b = randn(7, 64, device=device, grad=True), randn(3, 64, device=device, grad=True), randn(
            out_features, 3, device=device, grad=True)
        weight = randn(out_features, 64, device=device)
        bias = randn(out_features, device=device) if out_features == 96 else None  # extended K: a bias column
        for base in (weight, nf4.quantize(weight, 64), nf4.quantize(weight, 64, double_quant=True)):
            lora.lora_linear(x, base, a, b, 2.0, bias).float().square().sum().backward()


def run_logprobs(device: str) -> None:
    # hidden 64 on Hopper: both fused-epilogue GEMMs (776 ends in a partial vocab tile); 769, no multiple
    # of 8: the Hopper forward, the sm80 grad kernel; hidden 60: the sm80 path throughout
    for vocab, hidden_size in ((776, 64), (769, 64), (768, 60)):
        hidden = randn(9, hidden_size, device=device, grad=True)
        weight = randn(vocab, hidden_size, device=device, grad=True)
        ids = torch.randint(0, vocab, (9,), generator=GENERATOR).to(device)
        targets = logprobs.packed_targets(ids, torch.tensor([0, 4, 9], dtype=torch.int32, device=device))
        lp, entropy = logprobs.token_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
        (lp.sum() + entropy.sum()).backward()
    # A frozen lm_head (LoRA): the backward walks token chunks of 512 (kFrozenTokenChunk); 515 tokens
    # end on a chunk of 3.
    hidden = randn(515, 64, device=device, grad=True)
    weight = randn(776, 64, device=device)
    targets = torch.randint(0, 776, (515,), generator=GENERATOR).to(device)
    logprobs.token_logprobs(hidden, weight, targets, temperature=0.7).sum().backward()


def run_moe(device: str) -> None:
    tokens, hidden_size, intermediate, experts, top_k, rank = 7, 64, 32, 4, 2, 3
    hidden = randn(tokens, hidden_size, device=device, grad=True)
    logits = randn(tokens, experts, device=device).float()
    top_k_weights, top_k_index = moe.route(logits, top_k)
    moe.sort_tokens(top_k_index, experts)
    gate_up, down = randn(experts, 2 * intermediate, hidden_size, device=device), randn(
        experts, hidden_size, intermediate, device=device)
    out = moe.experts_forward(hidden, top_k_index, top_k_weights.to(DTYPE), gate_up, down)
    out.float().square().sum().backward()
    # LoRA on both projections (the Hopper core's accumulating products) and one assignment routed
    # to another rank's expert (a dropped slot: rows no GEMM writes)
    top_k_index = top_k_index.clone()
    top_k_index[0, 0] = experts
    adapters = {name: moe.LoRAFactors(randn(rank * experts, in_f, device=device, grad=True),
                                      randn(out_f, rank * experts, device=device, grad=True), 2.0)
                for name, out_f, in_f in (("gate_up_proj", 2 * intermediate, hidden_size),
                                          ("down_proj", hidden_size, intermediate))}
    out = moe.experts_forward(hidden, top_k_index, top_k_weights.to(DTYPE), gate_up, down, lora=adapters)
    out.float().square().sum().backward()
    # GPT-OSS' experts: weights stored [E, in, out] (transposed views, read in place on Hopper), gate and
    # up rows interleaved, biases, the clamped SwiGLU
    stored_gate_up = randn(experts, hidden_size, 2 * intermediate, device=device, grad=True)
    stored_down = randn(experts, intermediate, hidden_size, device=device, grad=True)
    biases = randn(experts, 2 * intermediate, device=device, grad=True), randn(experts, hidden_size, device=device,
                                                                              grad=True)
    out = moe.experts_forward(hidden, top_k_index, top_k_weights.to(DTYPE), stored_gate_up.transpose(1, 2),
                              stored_down.transpose(1, 2), moe.ClampedSwiGLU(), adapters,
                              *biases, True)
    out.float().square().sum().backward()


@contextlib.contextmanager
def environment(**values: str):
    """The variables set to values inside the block, then as the caller had them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def run_moe_act(device: str) -> None:
    """The gated gate_up GEMM (PYKERNELS_SM90_MOE_ACT=epilogue, set here too): intermediate 64 (whole
    pairs on the 128x128 tile only), then 128 on each tile (the rule picks 128x128 at these few rows),
    with and without LoRA, one assignment dropped."""
    tokens, hidden_size, experts, top_k, rank = 7, 64, 4, 2, 3
    hidden = randn(tokens, hidden_size, device=device, grad=True)
    top_k_weights, top_k_index = moe.route(randn(tokens, experts, device=device).float(), top_k)
    top_k_index = top_k_index.clone()
    top_k_index[0, 0] = experts
    for intermediate, tile in ((64, "auto"), (128, "auto"), (128, "128x256")):
        gate_up, down = randn(experts, 2 * intermediate, hidden_size, device=device), randn(
            experts, hidden_size, intermediate, device=device)
        adapters = {"gate_up_proj": moe.LoRAFactors(randn(rank * experts, hidden_size, device=device, grad=True),
                                                    randn(2 * intermediate, rank * experts, device=device, grad=True),
                                                    2.0)}
        with environment(PYKERNELS_SM90_MOE_ACT="epilogue", PYKERNELS_SM90_TILE=tile):
            for factors in (None, adapters):
                out = moe.experts_forward(hidden, top_k_index, top_k_weights.to(DTYPE), gate_up, down, lora=factors)
                out.float().square().sum().backward()


def run_lora_on_the_wide_tile(device: str) -> None:
    """run_lora with the core's 128x256 tile forced (its few rows pick 128x128): the tile the plain dense
    kernel (PYKERNELS_SM90_DENSE=plain, common/sm90_dense_plain.h) is built on."""
    with environment(PYKERNELS_SM90_TILE="128x256"):
        run_lora(device)


FAMILIES = {"nf4": run_nf4, "lora": run_lora, "logprobs": run_logprobs, "moe": run_moe}
# Families that run only under one of OTHER_SETTINGS (their default is another family's run).
SETTING_FAMILIES = {"moe_act": run_moe_act, "lora_wide": run_lora_on_the_wide_tile}


# The Hopper kernels' other settings, each with the family it runs: every core tile forced (the default
# picks by shape), the lm_head GEMMs' other tiles (the first is the default), the LoRA forward on
# cuBLAS, grad_x as one extended-K GEMM (lora/lora_extended_k.h), the rank products on fp32 FMA
# (lora/lora_rank_pieces.h), the core's tiles walked along N in swizzled blocks (common/sm90_tile_order.h),
# the NF4 decode in the GEMM (nf4/nf4_gemm_sm90.h), the experts' LoRA products as their own GEMMs
# (moe/moe.h), the NF4 dequantize by store units (nf4/nf4.h), the logprobs statistics folded on a
# lazy reference (logprobs/logprobs_sm90.h), the experts' activation in the gated gate_up GEMM's
# epilogue on each tile (common/paired_rows.h), and the experts' rows gathered in the GEMMs' mainloop
# (moe/moe.h), under both activation settings; the experts' rank products on the 128 x 32 tile (moe/moe.h);
# and the LoRA forward on the plain dense kernel (common/sm90_dense_plain.h).
OTHER_SETTINGS = [("PYKERNELS_SM90_TILE", tile, "moe") for tile in _C.host_logic.gemm_sm90_tiles] + [
    ("PYKERNELS_SM90_LOGPROBS_TILE", tile, "logprobs") for tile in _C.host_logic.logprobs_sm90_tiles[1:]] + [
    ("PYKERNELS_SM90_LORA", "cublas", "lora"), ("PYKERNELS_SM90_LORA_GRAD_X", "extended_k", "lora"),
    ("PYKERNELS_LORA_RANK_GEMM", "simt", "lora"), ("PYKERNELS_SM90_RASTER", "n8", "moe"),
    ("PYKERNELS_SM90_NF4", "mainloop", "lora"), ("PYKERNELS_SM90_MOE_LORA", "separate", "moe"),
    ("PYKERNELS_NF4_DEQUANT", "units", "nf4"), ("PYKERNELS_SM90_LOGPROBS_FOLD", "lazy_max", "logprobs")] + [
    ("PYKERNELS_SM90_MOE_ACT", "epilogue", "moe_act"), ("PYKERNELS_SM90_MOE_GATHER", "mainloop", "moe_act"),
    ("PYKERNELS_SM90_MOE_GATHER", "mainloop", "moe"), ("PYKERNELS_MOE_RANK_TILE", "narrow", "moe"),
    ("PYKERNELS_SM90_DENSE", "plain", "lora_wide")]


def run_family(family: str, device: str, setting: str = "") -> None:
    {**FAMILIES, **SETTING_FAMILIES}[family](device)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"{family}{setting}: ran on {device}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args(argv)
    pykernels.backend.set_kernels("ours")
    for family in FAMILIES:
        run_family(family, args.device)
    for variable, tile, family in OTHER_SETTINGS:
        os.environ[variable] = tile
        run_family(family, args.device, f" ({variable}={tile})")
        os.environ.pop(variable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
