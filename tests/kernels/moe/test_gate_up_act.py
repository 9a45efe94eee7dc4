"""moe_gate_up_act (csrc/moe/gate_up_act.h): an expert MLP's gate_up projection and its gated
activation as one op, whose Hopper kernel is one GEMM with the activation in its epilogue. Here its
CPU kernel and autograd against a direct fp64 statement (slot by slot, PEFT's LoRA layout, a dropped
assignment), the activation gradient's change of layout (paired in, the weight's layout out), the
experts_forward knob (PYKERNELS_SM90_MOE_ACT), opcheck and bad inputs. The fused kernel against the
separate path: tests/kernels/moe/test_moe_cuda.py (GPU)."""

import pytest
import torch

from pykernels import moe, moe_types
from pykernels._extension import ops

ACTS = {"silu": (0, 0.0, 0.0), "gelu_tanh": (2, 0.0, 0.0), "clamped_swiglu": (4, 1.702, 7.0)}


def routing(tokens, top_k, experts, seed, drop=True):
    generator = torch.Generator().manual_seed(seed)
    top_k_index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    if drop:
        top_k_index[0, 0] = experts  # another rank's expert: a dropped slot, zero rows out
    return top_k_index, moe.sort_tokens(top_k_index, experts)


def direct(x, weight, top_k_index, lora, act_name):
    """(inner, paired gate_up) in fp64, slot by slot: slot s holds assignment a (tokens' k choices
    ordered stably by expert, dropped ids last); row = W_e x_t (+ scaling B_e A_e x_t), its gate and up
    halves interleaved; inner = act(gate) * up (pykernels.moe_types, pure torch)."""
    tokens, top_k = top_k_index.shape
    experts, two_inner, _ = weight.shape
    ids = [int(e) if 0 <= int(e) < experts else experts for e in top_k_index.view(-1)]
    order = sorted(range(tokens * top_k), key=lambda a: (ids[a], a))
    rows = []
    for a in order:
        e, row = ids[a], x[a // top_k].double()
        if e == experts:
            rows.append(torch.zeros(two_inner, dtype=torch.float64))
            continue
        y = weight[e].double() @ row
        if lora is not None:
            r = lora.a.shape[0] // experts
            b_e = lora.b.double()[:, [e + i * experts for i in range(r)]]
            y = y + lora.scaling * b_e @ (lora.a.double()[e * r:(e + 1) * r] @ row)
        rows.append(y)
    gate_up = torch.stack(rows)
    inner = two_inner // 2
    paired = gate_up.view(-1, 2, inner).transpose(1, 2).reshape(-1, two_inner)
    act = moe_types.ClampedSwiGLU() if act_name == "clamped_swiglu" else act_name
    return moe_types.gated_activation(gate_up, act), paired


def call(x, weight, top_k_index, routed, lora, act_name):
    code, alpha, limit = ACTS[act_name]
    lora_a, lora_b, scaling = (lora.a, lora.b, lora.scaling) if lora is not None else (None, None, 1.0)
    return ops.moe_gate_up_act(x, weight, *routed, top_k_index.shape[1], False, lora_a, lora_b, scaling, code, alpha,
                               limit)


def inputs(tokens, hidden, inner, experts, top_k, rank, dtype, seed=0, grad=False):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).requires_grad_(grad)

    x = randn(tokens, hidden)
    weight = randn(experts, 2 * inner, hidden, scale=hidden ** -0.5)
    lora = None if rank == 0 else moe.LoRAFactors(randn(rank * experts, hidden, scale=0.1),
                                                   randn(2 * inner, rank * experts, scale=0.1), 1.5)
    return x, weight, lora


@pytest.mark.parametrize("act_name", ACTS)
@pytest.mark.parametrize("dtype,rank", [(torch.float32, 0), (torch.float32, 3), (torch.bfloat16, 2)])
def test_outputs_are_the_projection_paired_and_its_activation(act_name, dtype, rank):
    x, weight, lora = inputs(tokens=5, hidden=24, inner=7, experts=3, top_k=2, rank=rank, dtype=dtype)
    top_k_index, routed = routing(5, 2, 3, seed=1)
    inner, paired = call(x, weight, top_k_index, routed, lora, act_name)
    want_inner, want_paired = direct(x, weight, top_k_index, lora, act_name)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert inner.dtype == paired.dtype == dtype and inner.shape == (10, 7) and paired.shape == (10, 14)
    torch.testing.assert_close(paired.double(), want_paired, **tol)
    torch.testing.assert_close(inner.double(), want_inner, **tol)
    dropped = routed[0] == 3
    assert dropped.sum() == 1 and not paired[dropped].any() and not inner[dropped].any()


@pytest.mark.parametrize("act_name", ACTS)
@pytest.mark.parametrize("rank", [0, 2])
def test_gradients_reach_x_weight_and_the_lora_factors(act_name, rank):
    x, weight, lora = inputs(tokens=6, hidden=16, inner=5, experts=4, top_k=2, rank=rank, dtype=torch.float32,
                             grad=True)
    top_k_index, routed = routing(6, 2, 4, seed=2)
    grad_inner = torch.randn(12, 5, generator=torch.Generator().manual_seed(3))
    inner, paired = call(x, weight, top_k_index, routed, lora, act_name)
    assert not paired.requires_grad  # the saved pre-activation, not a result
    leaves = [x, weight] + ([lora.a, lora.b] if lora is not None else [])
    got = torch.autograd.grad(inner, leaves, grad_inner)
    want_inner, _ = direct(x, weight, top_k_index, lora, act_name)
    want = torch.autograd.grad(want_inner, leaves, grad_inner.double())
    for name, g, w in zip(["x", "weight", "lora_a", "lora_b"], got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("act", [0, 4])
def test_the_activation_gradient_can_leave_in_the_other_layout(act):
    """moe_gated_act_backward(grad_interleaved=False) on a paired (interleaved) pre-activation writes the
    gradient in gate-then-up halves: the paired input's gradient with its columns un-paired."""
    generator = torch.Generator().manual_seed(4)
    paired = torch.randn(9, 2 * 11, generator=generator)
    grad = torch.randn(9, 11, generator=generator)
    alpha, limit = (1.702, 7.0) if act == 4 else (0.0, 0.0)
    same = ops.moe_gated_act_backward(grad, paired, act, True, alpha, limit)
    halves = ops.moe_gated_act_backward(grad, paired, act, True, alpha, limit, grad_interleaved=False)
    torch.testing.assert_close(halves, torch.cat([same[:, 0::2], same[:, 1::2]], dim=1), rtol=0, atol=0)
    back = ops.moe_gated_act_backward(grad, torch.cat([paired[:, 0::2], paired[:, 1::2]], 1),
                                      act, False, alpha, limit, grad_interleaved=True)
    torch.testing.assert_close(back, same, rtol=0, atol=0)


def test_opcheck():
    x, weight, lora = inputs(tokens=4, hidden=8, inner=3, experts=2, top_k=2, rank=2, dtype=torch.float32,
                             grad=True)
    top_k_index, routed = routing(4, 2, 2, seed=5, drop=False)
    torch.library.opcheck(ops.moe_gate_up_act,
                          (x, weight, *routed, 2, False, lora.a, lora.b, 1.5, 0, 0.0, 0.0))


@pytest.mark.parametrize("bad,message", [
    (dict(weight=torch.randn(2, 5, 8)), "2 \\* intermediate"),
    (dict(weight=torch.randn(10, 8)), "2 \\* intermediate"),
    (dict(act=9), "act"),
])
def test_bad_inputs_are_named(bad, message):
    x, weight, _ = inputs(tokens=4, hidden=8, inner=3, experts=2, top_k=2, rank=0, dtype=torch.float32)
    top_k_index, routed = routing(4, 2, 2, seed=6, drop=False)
    weight = bad.get("weight", weight)
    with pytest.raises((ValueError, RuntimeError), match=message):
        ops.moe_gate_up_act(x, weight, *routed, 2, False, None, None, 1.0, bad.get("act", 0), 0.0, 0.0)


def test_the_knob_is_checked_and_keeps_cpu_tensors_on_the_separate_pass(monkeypatch):
    """PYKERNELS_SM90_MOE_ACT=epilogue asks for the fused op on CUDA tensors; CPU tensors keep the
    separate pass (the same result either way); any other value is named in a ValueError."""
    x, weight, _ = inputs(tokens=4, hidden=8, inner=3, experts=2, top_k=2, rank=0, dtype=torch.float32)
    down = torch.randn(2, 8, 3)
    top_k_index, _ = routing(4, 2, 2, seed=7, drop=False)
    top_k_weights = torch.rand(4, 2)
    separate = moe.experts_forward(x, top_k_index, top_k_weights, weight, down)
    monkeypatch.setenv("PYKERNELS_SM90_MOE_ACT", "epilogue")
    torch.testing.assert_close(moe.experts_forward(x, top_k_index, top_k_weights, weight, down), separate,
                               rtol=0, atol=0)
    monkeypatch.setenv("PYKERNELS_SM90_MOE_ACT", "fused")
    with pytest.raises(ValueError, match="PYKERNELS_SM90_MOE_ACT must be separate .* or epilogue"):
        moe.experts_forward(x, top_k_index, top_k_weights, weight, down)
