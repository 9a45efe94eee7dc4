"""CUDA grouped MoE ops on expert weights stored [E, in, out] (GPT-OSS' layout, passed as a
transposed view: read in place by the sm_90a GEMMs, copied for the sm80 kernels) and GPT-OSS'
experts (clamped SwiGLU, interleaved gate/up rows, biases): equal to the same ops on the
contiguous [E, out, in] weight up to summation order, and to the CPU ops.

Tolerance: the output and every gradient within one bf16 ulp of the largest magnitude, plus the
CPU ops within twice that (the same budget as test_moe_cuda.py's CPU comparison)."""

import pytest
import torch
from test_moe_experts_layouts import GPT_OSS, make_leaves, make_routing, run
from test_moe_ops import FLAGS

from conftest import requires_cuda
from pykernels import moe

pytestmark = [requires_cuda, pytest.mark.cuda]

# (tokens, top_k, experts, in, out, rank): multiples of 8 (the sm_90a GEMMs on Hopper, the tensor-core
# sm80 kernels elsewhere) and odd sizes (the SIMT kernels).
SHAPES = [(300, 4, 8, 256, 128, 5), (37, 3, 5, 33, 70, 1)]
FLAG_IDS = [f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS]


def close(a, b, ulps=1.0):
    scale = max(b.abs().max().item(), 1e-6)
    return (a.float() - b.float()).abs().max().item() <= ulps * 2.0**-7 * scale


@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=["mult8", "odd"])
def test_transposed_weights_equal_contiguous_weights(shape, grouped_in, grouped_out, with_gates, with_lora):
    tokens, top_k, experts, in_f, out_f, rank = shape
    g = torch.Generator().manual_seed(0)
    index = make_routing(tokens, top_k, experts, seed=0, dropped=2)
    stored = (torch.randn(experts, in_f, out_f, generator=g) * in_f**-0.5).bfloat16()  # [E, in, out]
    base = [torch.randn(tokens * top_k if grouped_in else tokens, in_f, generator=g).bfloat16(),
            torch.rand(tokens, top_k, generator=g).bfloat16(),
            (torch.randn(rank * experts, in_f, generator=g) * in_f**-0.5).bfloat16(),
            torch.randn(out_f, rank * experts, generator=g).bfloat16()]

    def forward_backward(device, weight_of):
        x, gates, a, b = (t.to(device).requires_grad_() for t in base)
        weight = stored.to(device).requires_grad_()
        lora = moe.LoRAFactors(a, b, 0.5) if with_lora else None
        routing = moe.sort_tokens(index.to(device), experts)
        y = moe.grouped_linear(x, weight_of(weight), *routing, grouped_in=grouped_in, grouped_out=grouped_out,
                               gates=gates if with_gates else None, lora=lora)
        used = [x, weight] + ([gates] if with_gates else []) + ([a, b] if with_lora else [])
        grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
        return [t.cpu() for t in (y, *torch.autograd.grad(y, used, grad_out))]

    transposed = forward_backward("cuda", lambda w: w.transpose(1, 2))
    contiguous = forward_backward("cuda", lambda w: w.transpose(1, 2).contiguous())
    cpu = forward_backward("cpu", lambda w: w.transpose(1, 2))
    for ours, same, on_cpu in zip(transposed, contiguous, cpu):
        assert close(ours, same) and close(ours, on_cpu, ulps=2.0)


def test_gpt_oss_experts_on_cuda_match_the_cpu():
    tokens, hidden, inter, experts, top_k = case = (83, 64, 48, 8, 4)
    index = make_routing(tokens, top_k, experts, seed=4, dropped=1)
    leaves = [t.detach().bfloat16() for t in make_leaves(*case, torch.float32, seed=5)]
    on_cpu = run(moe.experts_forward, index, [t.clone().requires_grad_() for t in leaves], GPT_OSS, True, True)
    on_cuda = run(moe.experts_forward, index.cuda(), [t.cuda().requires_grad_() for t in leaves], GPT_OSS, True,
                  True)
    for a, b in zip(on_cuda, on_cpu):
        assert close(a.cpu(), b, ulps=4.0)
