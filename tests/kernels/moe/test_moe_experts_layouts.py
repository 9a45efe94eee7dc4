"""experts_forward on the expert layouts beyond transformers' default (GPT-OSS: clamped SwiGLU, gate
and up rows interleaved, per-expert biases, weights stored [E, in, out] passed as transposed
views): against the fp64 reference, against transformers' own GptOssExperts (eager), in bf16
against torch's bf16 error, under torch.compile, on NF4 weights, on the torch side, and bad
inputs; grouped_linear on transposed weights (read in place by the CPU kernels) on every CPU path, and
opcheck on them."""

import itertools

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

import pykernels.nf4 as nf4
from pykernels import backend, moe
from pykernels._extension import ops
from pykernels.reference import moe as reference
from test_moe_ops import assert_bf16_matches_fp64
from tests.conftest import cpu_isas

# (tokens, hidden, inter, experts, top_k): odd token counts and feature sizes, one expert unrouted
# in the largest case, k = 1.
CASES = [(1, 24, 16, 4, 2), (7, 33, 18, 6, 2), (83, 40, 20, 8, 4), (13, 17, 9, 3, 1)]
GPT_OSS = moe.ClampedSwiGLU(alpha=1.702, limit=7.0)
# (act, interleaved, biases): GPT-OSS' full layout, and each of its parts on its own.
LAYOUTS = [(GPT_OSS, True, True), ("silu", False, True), ("gelu_tanh", True, False), (GPT_OSS, False, False)]
LAYOUT_IDS = ["gpt-oss", "silu-bias", "gelu-interleaved", "clamped-only"]


def make_routing(tokens, top_k, experts, seed, dropped=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].contiguous()  # distinct per token
    for i in range(dropped):  # another rank's experts under expert parallelism
        index.view(-1)[(5 * i) % index.numel()] = experts + i
    return index


def make_leaves(tokens, hidden, inter, experts, top_k, dtype, seed=0, rank=3):
    """hidden, top_k_weights, gate_up [E, H, 2I] and down [E, I, H] as GPT-OSS stores them, the two
    biases and LoRA factors; weights large enough that the clamps at +-7 engage."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    return [randn(tokens, hidden), torch.rand(tokens, top_k, generator=g, dtype=torch.float64).to(dtype)
            .requires_grad_(), randn(experts, hidden, 2 * inter, scale=8 / hidden**0.5),
            randn(experts, inter, hidden, scale=inter**-0.5), randn(experts, 2 * inter), randn(experts, hidden),
            randn(rank * experts, hidden, scale=0.3), randn(2 * inter, rank * experts, scale=0.3),
            randn(rank * experts, inter, scale=0.3), randn(hidden, rank * experts, scale=0.3)]


def run(fn, index, leaves, act, interleaved, biases, lora=True):
    """fn's output and the gradients of every leaf it used for a fixed random output gradient."""
    x, w, gate_up, down, gate_up_bias, down_bias, a1, b1, a2, b2 = leaves
    factors = {"gate_up_proj": moe.LoRAFactors(a1, b1, 0.5), "down_proj": moe.LoRAFactors(a2, b2, 2.0)}
    out = fn(x, index, w, gate_up.transpose(1, 2), down.transpose(1, 2), act, factors if lora else None,
             gate_up_bias if biases else None, down_bias if biases else None, interleaved)
    used = leaves[:4] + (leaves[4:6] if biases else []) + (leaves[6:] if lora else [])
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return [out, *torch.autograd.grad(out, used, grad_out.to(out.device, out.dtype))]


@pytest.mark.parametrize(("act", "interleaved", "biases"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}" for c in CASES])
def test_forward_and_gradients_match_the_fp64_reference(act, interleaved, biases, case):
    tokens, hidden, inter, experts, top_k = case
    index = make_routing(tokens, top_k, experts, seed=1, dropped=1 if tokens > 1 else 0)
    ours = run(moe.experts_forward, index, make_leaves(*case, torch.float32), act, interleaved, biases)
    exact = run(reference.experts_forward, index, make_leaves(*case, torch.float64), act, interleaved, biases)
    for i, (a, b) in enumerate(zip(ours, exact)):
        assert a.dtype == torch.float32 and a.shape == b.shape, i
        assert (a.double() - b).abs().max() <= 5e-6 * max(b.abs().max().item(), 1.0), i


def gpt_oss_experts(hidden, inter, experts, top_k, leaves):
    config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                       num_experts_per_tok=top_k, experts_implementation="eager")
    module = GptOssExperts(config)
    with torch.no_grad():
        for name, leaf in zip(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"), leaves[2:6]):
            getattr(module, name).data = leaf.detach().clone()
    return module.to(leaves[0].dtype)


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("case", CASES[:3], ids=[f"T{c[0]}" for c in CASES[:3]])
def test_gpt_oss_layout_matches_transformers_gpt_oss_experts(case, with_lora):
    """transformers' eager GptOssExperts (LoRA merged into its weights, as PEFT does) is the oracle."""
    tokens, hidden, inter, experts, top_k = case
    index = make_routing(tokens, top_k, experts, seed=2)
    leaves = make_leaves(*case, torch.float32, seed=3)
    module = gpt_oss_experts(hidden, inter, experts, top_k, leaves)
    gate_up_mid = (leaves[0].detach() @ module.gate_up_proj[0] + module.gate_up_proj_bias[0]).abs()
    assert (gate_up_mid > 7).any(), "the test's weights must drive the clamps"
    ours = run(moe.experts_forward, index, leaves, GPT_OSS, True, True, lora=with_lora)

    def eager(x, idx, w, gate_up, down, act, lora, gate_up_bias, down_bias, interleaved):
        for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            factors = (lora or {}).get(name)
            if factors is not None:  # W_e + s B_e A_e, stored transposed like the module's weight
                e = weight.shape[0]
                delta = torch.stack([factors.scaling * (factors.expert(i, e)[1] @ factors.expert(i, e)[0])
                                     for i in range(e)])
                weight = weight + delta
            module._parameters[name] = weight.transpose(1, 2)
        module._parameters["gate_up_proj_bias"], module._parameters["down_proj_bias"] = gate_up_bias, down_bias
        return module(x, idx, w)

    expected = run(eager, index, leaves, GPT_OSS, True, True, lora=with_lora)
    for i, (a, b) in enumerate(zip(ours, expected)):
        assert (a - b).abs().max() <= 2e-6 * max(b.abs().max().item(), 1.0), i


def test_bf16_is_as_close_to_fp64_as_transformers_bf16():
    tokens, hidden, inter, experts, top_k = case = (83, 64, 48, 8, 4)
    index = make_routing(tokens, top_k, experts, seed=4)
    leaves = make_leaves(*case, torch.float64, seed=5)
    exact = run(reference.experts_forward, index, leaves, GPT_OSS, True, True, lora=False)[0]
    bf16 = [leaf.detach().bfloat16() for leaf in leaves]
    ours = run(moe.experts_forward, index, [t.requires_grad_() for t in bf16], GPT_OSS, True, True, lora=False)[0]
    module = gpt_oss_experts(hidden, inter, experts, top_k, bf16)
    with torch.no_grad():
        eager = module(bf16[0], index, bf16[1])
    err_ours, err_eager = (ours.double() - exact).abs().max(), (eager.double() - exact).abs().max()
    assert ours.dtype == torch.bfloat16 and err_ours <= 2 * err_eager + 1e-3


def test_torch_compile_fullgraph_gpt_oss_layout():
    tokens, hidden, inter, experts, top_k = case = CASES[1]
    index = make_routing(tokens, top_k, experts, seed=6)
    leaves = make_leaves(*case, torch.float32, seed=7)
    eager = run(moe.experts_forward, index, leaves, GPT_OSS, True, True)
    compiled_fn = torch.compile(moe.experts_forward, fullgraph=True, dynamic=True)
    compiled = run(compiled_fn, index, leaves, GPT_OSS, True, True)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)


def test_torch_side_matches_ours():
    tokens, hidden, inter, experts, top_k = case = CASES[2]
    index = make_routing(tokens, top_k, experts, seed=8, dropped=2)
    leaves = make_leaves(*case, torch.float32, seed=9)
    ours = run(moe.experts_forward, index, leaves, GPT_OSS, True, True)
    with backend.forced("moe", "torch"):
        torch_side = run(moe.experts_forward, index, leaves, GPT_OSS, True, True)
    for a, b in zip(ours, torch_side):
        assert (a - b).abs().max() <= 2e-6 * max(b.abs().max().item(), 1.0)


def test_nf4_weights_with_biases_and_interleaved_rows():
    """NF4 weights are stored [E, out, in]: the GPT-OSS activation, interleaving and biases run on them too."""
    tokens, hidden, inter, experts, top_k = case = (37, 64, 32, 8, 2)
    index = make_routing(tokens, top_k, experts, seed=10, dropped=1)
    leaves = make_leaves(*case, torch.float32, seed=11)
    gate_up, down = (nf4.quantize(w.detach().transpose(1, 2).contiguous(), 64) for w in leaves[2:4])
    x, w, _, _, gate_up_bias, down_bias = leaves[:6]

    def forward(fn, gate_up_weight, down_weight):
        out = fn(x, index, w, gate_up_weight, down_weight, GPT_OSS, None, gate_up_bias, down_bias, True)
        return [out, *torch.autograd.grad(out.square().sum(), (x, w, gate_up_bias, down_bias))]

    ours = forward(moe.experts_forward, gate_up, down)
    dense = forward(reference.experts_forward, gate_up.dequantize(), down.dequantize())
    for a, b in zip(ours, dense):
        assert (a - b).abs().max() <= 2e-5 * max(b.abs().max().item(), 1.0)


def test_bad_layout_arguments_name_the_argument():
    x, w, index = torch.randn(6, 8), torch.rand(6, 2), make_routing(6, 2, 3, seed=0)
    gate_up, down = torch.randn(3, 10, 8), torch.randn(3, 8, 5)
    with pytest.raises(ValueError, match="act must be one of .*clamped_swiglu"):
        moe.experts_forward(x, index, w, gate_up, down, act="swiglu")
    with pytest.raises(ValueError, match="gate_up_bias must have shape \\(3, 10\\)"):
        moe.experts_forward(x, index, w, gate_up, down, gate_up_bias=torch.zeros(3, 5))
    with pytest.raises(ValueError, match="down_bias must have shape \\(3, 8\\)"):
        moe.experts_forward(x, index, w, gate_up, down, down_bias=torch.zeros(8))


FLAGS = list(itertools.product([False, True], [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("isa", cpu_isas(gemm=True))  # innermost: the fp64 oracle is computed once a case
@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS,
                         ids=[f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS])
@pytest.mark.parametrize("trainable_weight", [False, True], ids=["frozen", "trainable"])
def test_grouped_linear_on_transposed_weights_on_every_cpu_path(isa, grouped_in, grouped_out, with_gates, with_lora,
                                                                trainable_weight):
    """weight [E, out, in] as a transposed view of [E, in, out] (GPT-OSS' storage): bf16 forward and
    gradients against fp64 on the same bf16 inputs. > 256 slots for some experts, out 300: three
    column blocks, the last partial; in 77 odd."""
    tokens, top_k, num_experts, in_f, out_f, rank = 290, 3, 4, 77, 300, 5
    g = torch.Generator().manual_seed(12)
    index = make_routing(tokens, top_k, num_experts, seed=12, dropped=2)
    routing = moe.sort_tokens(index, num_experts)
    shapes = [(tokens * top_k if grouped_in else tokens, in_f), (num_experts, in_f, out_f), (tokens, top_k),
              (rank * num_experts, in_f), (out_f, rank * num_experts)]
    base = [(torch.randn(*s, generator=g) * (in_f**-0.5 if i in (1, 3) else 1.0)).bfloat16()
            for i, s in enumerate(shapes)]
    base[2] = torch.rand(tokens, top_k, generator=g).bfloat16()
    keep = [True, True, with_gates, with_lora, with_lora]
    need = [True, trainable_weight, with_gates, with_lora, with_lora]

    def run(dtype, fn):
        leaves = [t.to(dtype).requires_grad_(n) if k else None for t, k, n in zip(base, keep, need)]
        lora = moe.LoRAFactors(leaves[3], leaves[4], 0.5) if with_lora else None
        y = fn(leaves[0], leaves[1].transpose(1, 2), leaves[2], lora)
        grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(13)).to(dtype)
        return [y, *torch.autograd.grad(y, [t for t, n in zip(leaves, need) if n], grad_out)]

    assert_bf16_matches_fp64(run, routing, index, grouped_in, grouped_out, isa,
                             case=("transposed weights", with_gates, with_lora, trainable_weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_on_transposed_weights(dtype):
    index = make_routing(6, 2, 3, seed=14)
    routing = moe.sort_tokens(index, 3)
    x = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, 8, 5, dtype=dtype, requires_grad=True).transpose(1, 2)  # [E, out, in] view
    gates = torch.rand(6, 2, dtype=dtype, requires_grad=True)
    a, b = torch.randn(6, 8, dtype=dtype, requires_grad=True), torch.randn(5, 6, dtype=dtype, requires_grad=True)
    torch.library.opcheck(ops.moe_grouped_linear, (x, weight, *routing, 2, False, False, gates, a, b, 0.5))
