"""Grouped MoE ops (pykernels.moe): sort_tokens and grouped_linear against direct fp64
implementations, every layout flag, LoRA in PEFT's layout, dropped expert ids, zero-token experts,
k = 1, E = 1, odd sizes, opcheck, torch.compile and bad inputs."""

import itertools

import pytest
import torch

from pykernels import moe
from pykernels._extension import ops
from pykernels.reference import moe as reference
from tests.conftest import cpu_isas, forced_cpu_isa, oracle_once


def direct_grouped_linear(x, weight, top_k_index, grouped_in, grouped_out, gates, lora):
    """The op's contract, assignment by assignment in fp64: no sorting, no batching."""
    tokens, top_k = top_k_index.shape
    num_experts = weight.shape[0]
    x, weight = x.double(), weight.double()
    ids = [int(e) for e in top_k_index.view(-1)]
    ids = [e if 0 <= e < num_experts else num_experts for e in ids]  # dropped ids: a last bucket
    order = sorted(range(tokens * top_k), key=lambda a: (ids[a], a))  # slot order: stable sort by expert
    slot_of = {a: s for s, a in enumerate(order)}
    rows = []
    for a in range(tokens * top_k):
        e = ids[a]
        row = x[slot_of[a]] if grouped_in else x[a // top_k]
        if e == num_experts:
            rows.append(torch.zeros(weight.shape[1], dtype=torch.float64))
            continue
        y = weight[e] @ row
        if lora is not None:
            r = lora.a.shape[0] // num_experts
            y = y + lora.scaling * lora.b.double()[:, [e + i * num_experts for i in range(r)]] @ (
                lora.a.double()[e * r:(e + 1) * r] @ row)
        if gates is not None:
            y = y * gates.double().view(-1)[a]
        rows.append(y)
    y = torch.stack(rows) if rows else torch.zeros(0, weight.shape[1], dtype=torch.float64)
    if grouped_out:
        return y[order] if rows else y
    if gates is not None:
        return y.view(tokens, top_k, -1).sum(1)
    return y


def make_routing(tokens, top_k, num_experts, seed=0, dropped=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    for i in range(dropped):  # another rank's experts under expert parallelism
        idx.view(-1)[(7 * i) % idx.numel()] = num_experts + i
    return idx


@pytest.mark.parametrize(("tokens", "top_k", "num_experts"),
                         [(1, 1, 1), (13, 2, 4), (64, 8, 128), (5, 16, 512), (0, 2, 3), (40, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_sort_tokens_matches_a_stable_sort(tokens, top_k, num_experts, dtype):
    idx = make_routing(tokens, top_k, num_experts, dropped=2 if tokens > 4 else 0).to(dtype)
    sorted_expert, sorted_token, offsets = moe.sort_tokens(idx, num_experts)
    flat = idx.view(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    expected = sorted(range(flat.numel()), key=lambda a: (int(key[a]), a))
    assert sorted_token.tolist() == expected
    assert sorted_expert.tolist() == [int(key[a]) for a in expected]
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    assert offsets.tolist() == [0] + counts.cumsum(0).tolist()
    assert all(t.dtype == torch.int64 for t in (sorted_expert, sorted_token, offsets))
    for ours, ref in zip((sorted_expert, sorted_token, offsets), reference.sort_tokens(idx, num_experts)):
        assert torch.equal(ours, ref)


FLAGS = list(itertools.product([False, True], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS,
                         ids=[f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS])
@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "in_f", "out_f"),
                         [(11, 2, 5, 24, 33), (7, 1, 1, 17, 8), (30, 4, 9, 40, 19)])
def test_grouped_linear_forward_and_gradients_match_fp64(grouped_in, grouped_out, with_gates, with_lora, tokens,
                                                         top_k, num_experts, in_f, out_f):
    torch.manual_seed(0)
    idx = make_routing(tokens, top_k, num_experts, dropped=1)
    idx[0, 0] = 0  # experts 0 and 1 may well get no token: num_experts - 1 unused when E > tokens * k
    slots = tokens * top_k
    x = torch.randn(slots if grouped_in else tokens, in_f, dtype=torch.float64)
    weight = torch.randn(num_experts, out_f, in_f, dtype=torch.float64) / in_f**0.5
    gates = torch.rand(tokens, top_k, dtype=torch.float64) if with_gates else None
    r = 3
    lora = (torch.randn(r * num_experts, in_f, dtype=torch.float64),
            torch.randn(out_f, r * num_experts, dtype=torch.float64)) if with_lora else None
    routing = moe.sort_tokens(idx, num_experts)

    def run(fn_dtype, fn):
        leaves = [t.to(fn_dtype).requires_grad_() if t is not None else None
                  for t in (x, weight, gates, *(lora or (None, None)))]
        factors = moe.LoRAFactors(leaves[3], leaves[4], 0.7) if with_lora else None
        y = fn(leaves[0], leaves[1], leaves[2], factors)
        grad_out = torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view(y.shape).to(y.dtype)
        used = [t for t in leaves if t is not None]
        return [y] + list(torch.autograd.grad(y, used, grad_out))

    ours = run(torch.float32, lambda xx, ww, gg, ff: moe.grouped_linear(xx, ww, *routing, grouped_in=grouped_in,
                                                                        grouped_out=grouped_out, gates=gg, lora=ff))
    direct = run(torch.float64, lambda xx, ww, gg, ff: direct_grouped_linear(xx, ww, idx, grouped_in, grouped_out,
                                                                             gg, ff).to(xx.dtype))
    for name, a, b in zip(["y", "x", "weight", "gates", "lora_a", "lora_b"], ours, direct):
        scale = max(b.abs().max().item(), 1e-6) if b.numel() else 1.0
        assert a.shape == b.shape, name
        assert (a.double() - b).abs().max().item() <= 2e-6 * scale, name


def test_bf16_grouped_linear_is_as_close_to_fp64_as_torch_bf16():
    torch.manual_seed(1)
    tokens, top_k, num_experts, in_f, out_f = 50, 4, 8, 72, 40
    idx = make_routing(tokens, top_k, num_experts)
    x = torch.randn(tokens, in_f)
    weight = torch.randn(num_experts, out_f, in_f) / in_f**0.5
    gates = torch.rand(tokens, top_k)
    routing = moe.sort_tokens(idx, num_experts)
    exact = direct_grouped_linear(x, weight, idx, False, False, gates, None)
    ours = moe.grouped_linear(x.bfloat16(), weight.bfloat16(), *routing, gates=gates.bfloat16()).double()
    torch_bf16 = torch.stack([((weight.bfloat16()[int(e)] @ x.bfloat16()[t]) * gates.bfloat16()[t, j]).double()
                              for t in range(tokens) for j, e in enumerate(idx[t])]).view(tokens, top_k, -1).sum(1)
    assert (ours - exact).abs().max() <= (torch_bf16 - exact).abs().max() + 1e-3


def test_experts_forward_matches_the_reference_with_lora_and_dropped_ids():
    torch.manual_seed(0)
    tokens, hidden, inter, num_experts, top_k, r = 9, 24, 16, 5, 3, 4
    idx = make_routing(tokens, top_k, num_experts, dropped=1)

    def leaves(dtype):
        g = torch.Generator().manual_seed(2)
        return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in
                [(tokens, hidden), (tokens, top_k), (num_experts, 2 * inter, hidden), (num_experts, hidden, inter),
                 (r * num_experts, hidden), (2 * inter, r * num_experts), (r * num_experts, inter),
                 (hidden, r * num_experts)]]

    def run(fn, dtype):
        x, w, gu, dn, a1, b1, a2, b2 = ps = leaves(dtype)
        lora = {"gate_up_proj": moe.LoRAFactors(a1, b1, 0.5), "down_proj": moe.LoRAFactors(a2, b2, 2.0)}
        out = fn(x, idx, w, gu, dn, lora=lora)
        return [out] + list(torch.autograd.grad(out.square().sum(), ps))

    ours, ref = run(moe.experts_forward, torch.float32), run(reference.experts_forward, torch.float64)
    for a, b in zip(ours, ref):
        assert (a.double() - b).abs().max() <= 2e-6 * b.abs().max()


def test_opcheck():
    torch.manual_seed(0)
    idx = make_routing(6, 2, 3)
    torch.library.opcheck(ops.moe_sort_tokens, (idx, 3))
    routing = moe.sort_tokens(idx, 3)
    x, weight = torch.randn(6, 8, requires_grad=True), torch.randn(3, 5, 8, requires_grad=True)
    gates = torch.rand(6, 2, requires_grad=True)
    a, b = torch.randn(6, 8, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    torch.library.opcheck(ops.moe_grouped_linear, (x, weight, *routing, 2, False, False, gates, a, b, 0.5))
    torch.library.opcheck(ops.moe_grouped_linear, (torch.randn(12, 8), weight, *routing, 2, True, True))


def test_torch_compile_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    idx = make_routing(10, 2, 4)
    x = torch.randn(10, 16, requires_grad=True)
    gu, dn = torch.randn(4, 24, 16, requires_grad=True), torch.randn(4, 16, 12, requires_grad=True)
    w = torch.rand(10, 2, requires_grad=True)
    eager = moe.experts_forward(x, idx, w, gu, dn)
    compiled = torch.compile(moe.experts_forward, fullgraph=True, dynamic=True)(x, idx, w, gu, dn)
    torch.testing.assert_close(compiled, eager)
    g_eager = torch.autograd.grad(eager.sum(), (x, w, gu, dn))
    g_compiled = torch.autograd.grad(compiled.sum(), (x, w, gu, dn))
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b)


def test_bad_inputs_name_the_argument():
    idx = make_routing(6, 2, 3)
    routing = moe.sort_tokens(idx, 3)
    x, weight = torch.randn(6, 8), torch.randn(3, 5, 8)
    with pytest.raises(ValueError, match="top_k_index must be 2-D"):
        moe.sort_tokens(idx.view(-1), 3)
    with pytest.raises(ValueError, match="num_experts must be at least 1"):
        moe.sort_tokens(idx, 0)
    with pytest.raises(ValueError, match="top_k_index must be int64 or int32"):
        moe.sort_tokens(idx.float(), 3)
    with pytest.raises(ValueError, match="in_features"):
        moe.grouped_linear(torch.randn(6, 7), weight, *routing)
    with pytest.raises(ValueError, match="expert_offsets must have num_experts \\+ 1"):
        moe.grouped_linear(x, torch.randn(4, 5, 8), *routing)
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        moe.grouped_linear(x, weight.double(), *routing)
    with pytest.raises(ValueError, match="lora_a must have shape \\(r \\* 3, 8\\)"):
        moe.grouped_linear(x, weight, *routing, lora=moe.LoRAFactors(torch.randn(4, 8), torch.randn(5, 6), 1.0))
    with pytest.raises(ValueError, match="lora_b must have shape \\(5, 6\\)"):
        moe.grouped_linear(x, weight, *routing, lora=moe.LoRAFactors(torch.randn(6, 8), torch.randn(6, 5), 1.0))
    with pytest.raises(ValueError, match="gates must have shape \\(6, 2\\)"):
        moe.grouped_linear(x, weight, *routing, gates=torch.rand(6, 3))
    with pytest.raises(ValueError, match="x must have 12 rows"):
        moe.grouped_linear(x, weight, *routing, grouped_in=True, gates=torch.rand(6, 2))
    bad_offsets = routing[2].clone()
    bad_offsets[1] = 99
    with pytest.raises(ValueError, match="expert_offsets must be non-decreasing"):
        moe.grouped_linear(x, weight, routing[0], routing[1], bad_offsets)
    bad_tokens = routing[1].clone()
    bad_tokens[0] = -1
    with pytest.raises(ValueError, match="sorted_token_idx\\[0\\] = -1"):
        moe.grouped_linear(x, weight, routing[0], bad_tokens, routing[2])
    with pytest.raises(ValueError, match="act must be one of"):
        moe.experts_forward(x, idx, torch.rand(6, 2), torch.randn(3, 10, 8), torch.randn(3, 8, 5), act="swish")
    with pytest.raises(ValueError, match="gate_up_proj must be \\[E, 2I, H\\]"):
        moe.experts_forward(x, idx, torch.rand(6, 2), torch.randn(3, 9, 8), torch.randn(3, 8, 5))
    with pytest.raises(ValueError, match="lora keys"):
        moe.experts_forward(x, idx, torch.rand(6, 2), torch.randn(3, 10, 8), torch.randn(3, 8, 5),
                            lora={"up_proj": None})


@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS,
                         ids=[f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS])
@pytest.mark.parametrize(("tokens", "top_k", "num_experts", "in_f", "out_f", "rank"),
                         # odd in; > 256 slots and > 512 rows; <= 8 slots an expert (portable: rowwise_bf16)
                         [(37, 3, 5, 33, 70, 1), (600, 2, 3, 64, 600, 16), (9, 2, 7, 33, 70, 2)],
                         ids=["small-odd", "chunked", "few-slots"])
def test_bf16_forward_on_every_cpu_path(gemm_cpu_isa, grouped_in, grouped_out, with_gates, with_lora, tokens, top_k,
                                        num_experts, in_f, out_f, rank):
    """bf16 in, bf16 out: within bf16 rounding of the fp64 result of the same bf16 inputs, on the
    AVX-512 BF16 kernels (their GEMMs on AVX-512 and on AMX tiles) and on the portable path."""
    g = torch.Generator().manual_seed(3)
    idx = make_routing(tokens, top_k, num_experts, seed=3, dropped=1)
    routing = moe.sort_tokens(idx, num_experts)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    x = rand(tokens * top_k if grouped_in else tokens, in_f)
    weight = rand(num_experts, out_f, in_f, scale=in_f**-0.5)
    gates = torch.rand(tokens, top_k, generator=g).bfloat16() if with_gates else None
    lora = moe.LoRAFactors(rand(rank * num_experts, in_f, scale=in_f**-0.5), rand(out_f, rank * num_experts),
                           0.5) if with_lora else None
    ours = moe.grouped_linear(x, weight, *routing, grouped_in=grouped_in, grouped_out=grouped_out, gates=gates,
                              lora=lora)
    exact = direct_grouped_linear(x, weight, idx, grouped_in, grouped_out, gates, lora)
    assert ours.dtype == torch.bfloat16 and ours.shape == exact.shape
    # bf16 output rounding (2^-8 relative) plus LoRA's bf16 intermediate and the per-token sum.
    assert (ours.double() - exact).abs().max() <= 2**-7 * exact.abs().max()


@pytest.mark.parametrize("isa", cpu_isas(gemm=True))  # innermost: the fp64 oracle is computed once a case
@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS,
                         ids=[f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS])
@pytest.mark.parametrize("trainable_weight", [False, True], ids=["frozen", "trainable"])
def test_bf16_gradients_on_every_cpu_path(isa, grouped_in, grouped_out, with_gates, with_lora, trainable_weight):
    """bf16 gradients of x, gates, LoRA (and the weight when it is trainable) against fp64 on the
    same bf16 inputs, on the AVX-512 BF16 kernels (frozen weight; their GEMMs on AVX-512 and on AMX
    tiles) and the portable path."""
    # > 256 slots for some experts; in 151: two column blocks of the backward, the second odd and partial
    tokens, top_k, num_experts, in_f, out_f, rank = 300, 3, 4, 151, 72, 5
    g = torch.Generator().manual_seed(5)
    idx = make_routing(tokens, top_k, num_experts, seed=5, dropped=2)
    routing = moe.sort_tokens(idx, num_experts)
    shapes = [(tokens * top_k if grouped_in else tokens, in_f), (num_experts, out_f, in_f), (tokens, top_k),
              (rank * num_experts, in_f), (out_f, rank * num_experts)]
    base = [(torch.randn(*s, generator=g) * (in_f**-0.5 if i in (1, 3) else 1.0)).bfloat16()
            for i, s in enumerate(shapes)]
    base[2] = torch.rand(tokens, top_k, generator=g).bfloat16()
    used = [True, trainable_weight, with_gates, with_lora, with_lora]

    def run(dtype, fn):
        leaves = [t.to(dtype).requires_grad_(need) if keep else None
                  for t, keep, need in zip(base, [True, True, with_gates, with_lora, with_lora], used)]
        lora = moe.LoRAFactors(leaves[3], leaves[4], 0.5) if with_lora else None
        y = fn(leaves[0], leaves[1], leaves[2], lora)
        grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
        grads = torch.autograd.grad(y, [t for t, need in zip(leaves, used) if need], grad_out)
        return grads

    assert_bf16_matches_fp64(run, routing, idx, grouped_in, grouped_out, isa,
                             case=("moe_ops bf16 gradients", with_gates, with_lora, trainable_weight))


def assert_bf16_matches_fp64(run, routing, top_k_index, grouped_in, grouped_out, isa, case: tuple):
    """run(dtype, fn): a case's tensors (fn(x, weight, gates, lora) and its gradients) in dtype. Ours in bf16 on the
    CPU path `isa` against direct_grouped_linear in fp64, computed once for the case's CPU paths (oracle_once; `case`
    with grouped_in and grouped_out names it): within bf16 output rounding plus LoRA's bf16 intermediate and the
    per-token sum."""
    with forced_cpu_isa(isa):
        ours = run(torch.bfloat16, lambda xx, ww, gg, ff: moe.grouped_linear(
            xx, ww, *routing, grouped_in=grouped_in, grouped_out=grouped_out, gates=gg, lora=ff))
    exact = oracle_once((*case, grouped_in, grouped_out), lambda: run(torch.float64, lambda xx, ww, gg, ff: (
        direct_grouped_linear(xx, ww, top_k_index, grouped_in, grouped_out, gg, ff))))
    for a, b in zip(ours, exact):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a.double() - b).abs().max() <= 2**-7 * b.abs().max()
