"""The expert MLP's gated activation as one op (pykernels.moe.gated_activation, csrc/moe/gated_act.h)
against fp64: the formulas of pykernels.moe_types (transformers' and GPT-OSS' activations), forward
and gradients by torch autograd in fp64. Each output is computed in fp32 and rounded once, so it
must lie within half an ulp of the fp64 value (plus fp32's own error), a bound torch eager's bf16
SwiGLU (which rounds silu(gate) before the product) breaks. Every CPU path (scalar, AVX-512) and,
on a GPU, CUDA (packed and element-wise kernels)."""

import math

import pytest
import torch

import pykernels.moe as moe
from conftest import requires_cuda
from pykernels import moe_types
from pykernels._extension import ops
from tests.conftest import cpu_isas, forced_cpu_isa

ACTS = ["silu", "gelu", "gelu_tanh", "relu", "clamped_swiglu", moe_types.ClampedSwiGLU(alpha=1.3, limit=2.5)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (7, 5), (33, 17), (64, 768), (3, 3584)]  # (rows, intermediate)
MANTISSA = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def act_id(act):
    return str(act).split("(")[0] if not isinstance(act, moe_types.ClampedSwiGLU) else "clamped_swiglu_custom"


def make_gate_up(rows, inner, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inner, generator=g) * 3
    if rows * inner >= 4:  # the clamp's edges and zero
        gate_up.view(-1)[:4] = torch.tensor([7.0, -7.0, 0.0, 2.5])
    return gate_up.to(dtype).to(device)


def exact(gate_up, act, interleaved, weights=None):
    """fp64 inner and, with weights, d sum(inner * weights) / d gate_up."""
    x = gate_up.detach().double().cpu().requires_grad_(weights is not None)
    inner = moe_types.gated_activation(x, act, interleaved)
    if weights is None:
        return inner.detach(), None
    (inner * weights.double().cpu()).sum().backward()
    return inner.detach(), x.grad


def within_one_rounding(got, want, dtype, scale):
    """|got - want| <= half an ulp of dtype at |want| (one rounding of an exact result) plus fp32's
    error on the way (a few 2^-24 of the inputs' scale)."""
    got, want = got.double().cpu(), want.double()
    ulp = torch.where(want.abs() > 0, torch.exp2(torch.floor(torch.log2(want.abs()))), torch.zeros_like(want))
    bound = 0.5 * ulp * 2.0 ** (1 - MANTISSA[dtype]) + 2.0 ** -20 * scale + torch.finfo(dtype).tiny
    return ((got - want).abs() <= bound) | (got.isnan() & want.isnan())


def check(gate_up, act, interleaved, device_result=None):
    rows, width = gate_up.shape
    weights = torch.randn(rows, width // 2, generator=torch.Generator().manual_seed(1)).to(gate_up.dtype)
    want, want_grad = exact(gate_up, act, interleaved, weights)
    x = gate_up.detach().requires_grad_()  # same storage: a misaligned view stays misaligned
    inner = moe.gated_activation(x, act, interleaved)
    inner.backward(weights.to(x.device))
    assert inner.dtype == gate_up.dtype and inner.shape == (rows, width // 2)
    scale = float(want.abs().max()) if want.numel() else 1.0
    grad_scale = float(want_grad.abs().max()) if want_grad.numel() else 1.0
    assert within_one_rounding(inner, want, gate_up.dtype, scale).all(), "forward"
    assert within_one_rounding(x.grad, want_grad, gate_up.dtype, grad_scale).all(), "backward"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rows{s[0]}-inter{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
@pytest.mark.parametrize("act", ACTS, ids=act_id)
def test_cpu_is_one_rounding_of_fp64(act, interleaved, dtype, shape, avx2_cpu_isa):
    check(make_gate_up(*shape, dtype), act, interleaved)


def test_torch_eager_bf16_swiglu_rounds_twice():
    """The bound above is tight enough to tell: torch eager's bf16 silu(gate) * up breaks it."""
    gate_up = make_gate_up(64, 768, torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    eager = torch.nn.functional.silu(gate) * up
    want, _ = exact(gate_up, "silu", False)
    assert not within_one_rounding(eager, want, torch.bfloat16, float(want.abs().max())).all()


def test_nan_propagates_and_clamps_pass_gradient_like_torch(avx2_cpu_isa):
    gate_up = torch.tensor([[float("nan"), 8.0, 7.0, 1.0, 2.0, 3.0, -8.0, 7.0]])  # gate 4 columns, up 4
    for act in ["silu", "relu", "clamped_swiglu"]:
        inner = moe.gated_activation(gate_up.bfloat16(), act)
        assert inner[0, 0].isnan(), act
    x = gate_up.clone().requires_grad_()
    moe.gated_activation(x, "clamped_swiglu").sum().backward()
    ref = gate_up.clone().requires_grad_()
    moe_types.gated_activation(ref, "clamped_swiglu").sum().backward()
    assert torch.equal(x.grad[0, 1:].isnan(), ref.grad[0, 1:].isnan())
    torch.testing.assert_close(x.grad[0, 1:].nan_to_num(), ref.grad[0, 1:].nan_to_num())
    assert x.grad[0, 1] == 0 and x.grad[0, 6] == 0  # gate 8 > limit 7, up -8 < -limit: no gradient


def test_no_rows():
    x = torch.empty(0, 10, requires_grad=True)
    inner = moe.gated_activation(x, "silu")
    inner.sum().backward()
    assert inner.shape == (0, 5) and x.grad.shape == (0, 10)


@pytest.mark.parametrize("bad, message", [
    (lambda: moe.gated_activation(torch.randn(4, 7), "silu"), "2-D .rows, 2 . intermediate."),
    (lambda: moe.gated_activation(torch.randn(8), "silu"), "2-D .rows, 2 . intermediate."),
    (lambda: moe.gated_activation(torch.randn(4, 8), "swish"), "act must be one of"),
    (lambda: ops.moe_gated_act(torch.randn(4, 8), 9, False, 0.0, 0.0), r"act must be a code in \[0, 5\)"),
    (lambda: ops.moe_gated_act(torch.randn(4, 16)[:, ::2], 0, False, 0.0, 0.0), "gate_up must be contiguous"),
    (lambda: ops.moe_gated_act(torch.randint(0, 3, (4, 8)), 0, False, 0.0, 0.0), "gate_up"),
    (lambda: ops.moe_gated_act_backward(torch.randn(4, 3), torch.randn(4, 8), 0, False, 0.0, 0.0),
     r"grad_inner must be \[rows, intermediate\] = \(4, 4\), got \(4, 3\)"),
    (lambda: ops.moe_gated_act_backward(torch.randn(4, 4).double(), torch.randn(4, 8), 0, False, 0.0, 0.0),
     "grad_inner must have gate_up's dtype"),
])
def test_bad_inputs_name_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_opcheck_and_compile():
    gate_up = make_gate_up(7, 5, torch.bfloat16)
    torch.library.opcheck(ops.moe_gated_act, (gate_up, 4, True, 1.702, 7.0))
    torch.library.opcheck(ops.moe_gated_act_backward, (torch.randn(7, 5).bfloat16(), gate_up, 0, False, 0.0, 0.0))
    torch._dynamo.reset()
    x = gate_up.clone().requires_grad_()

    def step(x):
        return moe.gated_activation(x, "silu").float().square().sum()

    torch.compile(step, fullgraph=True)(x).backward()
    compiled, x.grad = x.grad.clone(), None
    step(x).backward()
    torch.testing.assert_close(compiled, x.grad)


@pytest.mark.parametrize("isa", [isa for isa in cpu_isas(avx2=True) if isa != "scalar"])
def test_cpu_vector_paths_and_scalar_agree_to_rounding(isa):
    """The vector paths (Cephes' exp polynomial) and the scalar one (libm's expf) round the same fp32
    values: they may differ by one ulp of bf16 where fp32 lands next to a rounding boundary, never
    more. Gates reach +-100, where exp under- and overflows."""
    gate_up = make_gate_up(64, 771, torch.bfloat16)
    gate_up[:, :771] *= torch.linspace(0.1, 25.0, 771).bfloat16()
    results = {}
    for path in ("scalar", isa):
        with forced_cpu_isa(path):
            x = gate_up.clone().requires_grad_()
            out = moe.gated_activation(x, "silu")
            out.backward(torch.ones_like(out))
            results[path] = (out.detach().double(), x.grad.double())
    for want, got in zip(results["scalar"], results[isa], strict=True):
        gap = (want - got).abs() / want.abs().clamp(min=1e-30)
        assert float(gap.max()) <= 2.0 ** -7 and math.isfinite(float(gap.max()))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["packed", "elementwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["concatenated", "interleaved"])
@pytest.mark.parametrize("act", ACTS, ids=act_id)
def test_cuda_is_one_rounding_of_fp64(act, interleaved, dtype, offset):
    """offset 1: gate_up starts mid-allocation, so the kernel takes its element-wise variant."""
    for rows, inner in [(33, 17), (64, 768), (3, 3584)]:
        gate_up = make_gate_up(rows, inner, dtype)
        storage = torch.empty(gate_up.numel() + offset, dtype=dtype, device="cuda")
        storage[offset:] = gate_up.cuda().flatten()
        check(storage[offset:].view(rows, 2 * inner), act, interleaved)
