"""The Hopper gated gate_up GEMM (csrc/common/paired_rows.h, csrc/moe/gated_act_visitor_sm90.cuh) on a
GPU: moe_gate_up_act's fused kernel against fp64 (pykernels.reference's grouped linear on fp64 copies,
its rows paired, the activation in fp64), with the separate path (the same op's composition: the
core's ungated GEMM, then the activation pass) as the error yardstick:

    max|fused - fp64| <= 2 max|separate - fp64| + one bf16 ulp of the largest |fp64|

and inner == act(the paired output it wrote) to one bf16 ulp (both from the same bf16 values); with x's
rows gathered by a pass or in the GEMM's mainloop (PYKERNELS_SM90_MOE_GATHER). Also experts_forward
with PYKERNELS_SM90_MOE_ACT=epilogue against the default, forward and backward (frozen experts: the
down projection's grad_x gathers dy in its mainloop under PYKERNELS_SM90_MOE_GATHER=mainloop), and no
host synchronization. The CPU op and the index logic: test_gate_up_act.py, test_gated_gemm_host.py."""

import pytest
import torch
from cuda_sync import no_host_sync

from conftest import requires_cuda
from pykernels import moe, moe_types
from pykernels._extension import ops
from pykernels.reference import moe as reference

pytestmark = [requires_cuda, pytest.mark.cuda]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
BF16_ULP = 2.0**-7
ACTS = {"silu": (0, 0.0, 0.0), "clamped_swiglu": (4, 1.702, 7.0)}

# (tokens, top_k, experts, hidden, inner, rank): several 128-row tiles per expert; most of 512
# experts empty; Qwen3-30B-A3B's expert sizes (hidden 2048, inner 768) at 97 tokens; inner 64 (only
# the 128x128 tile holds whole pairs: the 128x256 rule falls back to it).
SHAPES = [(300, 4, 8, 256, 128, 0), (300, 4, 8, 256, 128, 5), (40, 4, 512, 64, 64, 16), (97, 8, 128, 2048, 768, 16),
          (33, 2, 4, 128, 64, 0)]


def shape_id(shape):
    return "T{}-k{}-E{}-h{}-i{}-r{}".format(*shape)


def make(shape, seed=0):
    tokens, top_k, experts, hidden, inner, rank = shape
    g = torch.Generator().manual_seed(seed)
    top_k_index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    top_k_index[0, 0] = experts  # a dropped assignment (another rank's expert)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).bfloat16().cuda()

    x, weight = randn(tokens, hidden), randn(experts, 2 * inner, hidden, scale=hidden ** -0.5)
    lora = None if rank == 0 else moe.LoRAFactors(randn(rank * experts, hidden, scale=0.1),
                                                   randn(2 * inner, rank * experts, scale=0.1), 2.0)
    return top_k_index.cuda(), x, weight, lora


def gate_up_act(x, weight, top_k_index, lora, act_name):
    routed = moe.sort_tokens(top_k_index, weight.shape[0])
    code, alpha, limit = ACTS[act_name]
    lora_args = (lora.a, lora.b, lora.scaling) if lora is not None else (None, None, 1.0)
    return ops.moe_gate_up_act(x, weight, *routed, top_k_index.shape[1], False, *lora_args, code, alpha, limit)


def exact(x, weight, top_k_index, lora, act_name):
    routed = moe.sort_tokens(top_k_index, weight.shape[0])
    lora64 = None if lora is None else moe.LoRAFactors(lora.a.double(), lora.b.double(), lora.scaling)
    rows = reference.grouped_linear(x.double(), weight.double(), *routed, top_k_index.shape[1], False, True, None,
                                    lora64)
    inner = rows.shape[1] // 2
    act = moe_types.ClampedSwiGLU() if act_name == "clamped_swiglu" else act_name
    paired = rows.view(-1, 2, inner).transpose(1, 2).reshape(rows.shape)
    return moe_types.gated_activation(rows, act), paired


def separate(x, weight, top_k_index, lora, act_name):
    """The composition on the same GPU: the op with the fused kernel refused (an unpaired tile)."""
    routed = moe.sort_tokens(top_k_index, weight.shape[0])
    rows = moe.grouped_linear(x, weight, *routed, grouped_out=True, lora=lora)
    inner = rows.shape[1] // 2
    paired = rows.view(-1, 2, inner).transpose(1, 2).reshape(rows.shape)
    act = moe_types.ClampedSwiGLU() if act_name == "clamped_swiglu" else act_name
    return moe.gated_activation(paired, act, interleaved=True), paired


def assert_within_budget(name, got, lowprec, want):
    scale = want.abs().max().item()
    err = (got.double() - want).abs().max().item()
    budget = 2 * (lowprec.double() - want).abs().max().item() + BF16_ULP * scale
    assert err <= budget, f"{name}: max error {err:.3e} over the budget {budget:.3e}"


@pytest.mark.skipif(not HOPPER, reason="the gated GEMM runs on compute capability 9.0")
@pytest.mark.parametrize("gather", ["pass", "mainloop"])
@pytest.mark.parametrize("tile", ["auto", "128x128", "128x256"])
@pytest.mark.parametrize("act_name", ACTS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_fused_gate_up_and_activation_match_fp64(shape, act_name, tile, gather, monkeypatch):
    monkeypatch.setenv("PYKERNELS_SM90_TILE", tile)
    monkeypatch.setenv("PYKERNELS_SM90_MOE_GATHER", gather)
    top_k_index, x, weight, lora = make(shape)
    with no_host_sync():
        inner, paired = gate_up_act(x, weight, top_k_index, lora, act_name)
    want_inner, want_paired = exact(x, weight, top_k_index, lora, act_name)
    low_inner, low_paired = separate(x, weight, top_k_index, lora, act_name)
    assert_within_budget("gate_up", paired, low_paired, want_paired)
    assert_within_budget("inner", inner, low_inner, want_inner)
    act = moe_types.ClampedSwiGLU() if act_name == "clamped_swiglu" else act_name
    from_paired = moe.gated_activation(paired, act, interleaved=True)
    torch.testing.assert_close(inner.double(), from_paired.double(), rtol=BF16_ULP, atol=0)
    dropped = moe.sort_tokens(top_k_index, weight.shape[0])[0] == weight.shape[0]
    assert not paired[dropped].any() and not inner[dropped].any()


@pytest.mark.skipif(not HOPPER, reason="the gated GEMM runs on compute capability 9.0")
@pytest.mark.parametrize("gather", ["pass", "mainloop"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3]], ids=shape_id)
def test_experts_forward_with_the_activation_in_the_epilogue(shape, gather, monkeypatch):
    """PYKERNELS_SM90_MOE_ACT=epilogue against the default (separate pass): output and every gradient
    (hidden, routing weights, LoRA factors of both projections) within the separate path's own error
    against fp64 (pykernels.reference.experts_forward on fp64 copies)."""
    tokens, top_k, experts, hidden, inner, rank = shape
    top_k_index, x, gate_up, lora = make(shape, seed=1)
    g = torch.Generator().manual_seed(2)
    down = (torch.randn(experts, hidden, inner, generator=g) * inner ** -0.5).bfloat16().cuda()
    weights = torch.rand(tokens, top_k, generator=g).cuda()
    adapters = {} if lora is None else {
        "gate_up_proj": lora,
        "down_proj": moe.LoRAFactors((torch.randn(rank * experts, inner, generator=g) * 0.1).bfloat16().cuda(),
                                     (torch.randn(hidden, rank * experts, generator=g) * 0.1).bfloat16().cuda(),
                                     2.0)}
    grad_out = torch.randn(tokens, hidden, generator=g).bfloat16().cuda()

    def run(setting, dtype):
        monkeypatch.setenv("PYKERNELS_SM90_MOE_ACT", setting)
        leaves = {"hidden": x.to(dtype).requires_grad_(), "weights": weights.double().requires_grad_()
                  if dtype == torch.float64 else weights.clone().requires_grad_()}
        for name, factors in adapters.items():
            leaves[f"{name}.a"] = factors.a.to(dtype).requires_grad_()
            leaves[f"{name}.b"] = factors.b.to(dtype).requires_grad_()
        lora_now = {name: moe.LoRAFactors(leaves[f"{name}.a"], leaves[f"{name}.b"], f.scaling)
                    for name, f in adapters.items()}
        forward = reference.experts_forward if dtype == torch.float64 else moe.experts_forward
        out = forward(leaves["hidden"], top_k_index, leaves["weights"], gate_up.to(dtype), down.to(dtype), "silu",
                      lora_now)
        grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(dtype))
        return {"out": out, **dict(zip(leaves, grads))}

    want = run("separate", torch.float64)
    base = run("separate", torch.bfloat16)
    monkeypatch.setenv("PYKERNELS_SM90_MOE_GATHER", gather)
    fused = run("epilogue", torch.bfloat16)
    for name in want:
        assert_within_budget(name, fused[name], base[name], want[name])
