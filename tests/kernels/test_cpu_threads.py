"""The CPU kernels with two threads give what they give with one.

make test runs every test single-threaded (tests/conftest.py pins each pytest worker to a core with
torch.set_num_threads(1)), so the kernels' parallel paths (work split over at::parallel_for threads,
per-thread buffers and accumulators) would otherwise run nowhere in CI. A buffer named by a lambda
that other threads run is each thread's own: that gave the MoE forward on GPT-OSS' [E, in, out]
weights with LoRA an empty buffer on the second thread and a segfault, which the single-threaded
layout tests never saw. Here each op runs forward and backward at sizes that split over threads,
under 1 and then 2 threads (both on the worker's core), and the results must agree: bit for bit
where the kernels fix their summation order, else within float32 rounding of the per-thread sums.
"""

from contextlib import contextmanager

import pytest
import torch

import pykernels.nf4 as nf4
from pykernels import logprobs, lora, moe

pytestmark = pytest.mark.usefixtures("gemm_cpu_isa")


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def on_1_and_2_threads(fn):
    with threads(1):
        one = fn()
    with threads(2):
        two = fn()
    assert len(one) == len(two)
    return list(zip(one, two))


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def outputs_and_grads(out, inputs, seed=0):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad_out)]


@pytest.mark.parametrize("transposed", [False, True], ids=["stored-out-in", "stored-in-out"])
def test_moe_grouped_linear_with_lora_and_gates(transposed):
    tokens, top_k, experts, in_f, out_f, rank = 290, 3, 4, 77, 300, 5  # 12 (expert, column block) items
    g = torch.Generator().manual_seed(0)
    index = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].contiguous()
    routing = moe.sort_tokens(index, experts)
    stored = (torch.randn(experts, in_f, out_f, generator=g) * in_f**-0.5).bfloat16()
    weight = stored if transposed else stored.transpose(1, 2).contiguous()
    base = [torch.randn(tokens, in_f, generator=g).bfloat16(), weight,
            torch.rand(tokens, top_k, generator=g).bfloat16(),
            (torch.randn(rank * experts, in_f, generator=g) * in_f**-0.5).bfloat16(),
            torch.randn(out_f, rank * experts, generator=g).bfloat16()]

    def run():
        x, w, gates, a, b = leaves(*base)
        y = moe.grouped_linear(x, w.transpose(1, 2) if transposed else w, *routing, gates=gates,
                               lora=moe.LoRAFactors(a, b, 0.5))
        return outputs_and_grads(y, [x, w, gates, a, b])

    for one, two in on_1_and_2_threads(run):
        assert torch.equal(one, two)  # per-thread work in a fixed order


def test_moe_gpt_oss_experts_with_lora():
    tokens, hidden, inter, experts, top_k, rank = 150, 64, 48, 8, 4, 3
    g = torch.Generator().manual_seed(1)
    index = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :top_k].contiguous()
    base = [torch.randn(tokens, hidden, generator=g).bfloat16(), torch.rand(tokens, top_k, generator=g).bfloat16(),
            (torch.randn(experts, hidden, 2 * inter, generator=g) * hidden**-0.5).bfloat16(),  # [E, in, out]
            (torch.randn(experts, inter, hidden, generator=g) * inter**-0.5).bfloat16(),
            torch.randn(experts, 2 * inter, generator=g).bfloat16(),
            torch.randn(experts, hidden, generator=g).bfloat16(),
            (torch.randn(rank * experts, hidden, generator=g) * 0.3).bfloat16(),
            (torch.randn(2 * inter, rank * experts, generator=g) * 0.3).bfloat16(),
            (torch.randn(rank * experts, inter, generator=g) * 0.3).bfloat16(),
            (torch.randn(hidden, rank * experts, generator=g) * 0.3).bfloat16()]

    def run():
        x, w, gate_up, down, gate_up_bias, down_bias, a1, b1, a2, b2 = inputs = leaves(*base)
        factors = {"gate_up_proj": moe.LoRAFactors(a1, b1, 0.5), "down_proj": moe.LoRAFactors(a2, b2, 2.0)}
        out = moe.experts_forward(x, index, w, gate_up.transpose(1, 2), down.transpose(1, 2),
                                  moe.ClampedSwiGLU(), factors, gate_up_bias, down_bias, True)
        return outputs_and_grads(out, inputs)

    for one, two in on_1_and_2_threads(run):
        assert torch.equal(one, two)


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])
def test_lora_linear(quantized):
    rows, k, n, r = 3000, 128, 96, 8
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    base = [torch.randn(rows, k, generator=g).bfloat16(), torch.randn(r, k, generator=g) / k**0.5,
            torch.randn(n, r, generator=g) / r**0.5]
    frozen = nf4.quantize(weight, 64) if quantized else weight

    def run():
        x, a, b = inputs = leaves(*base)
        return outputs_and_grads(lora.lora_linear(x, frozen, a, b, 2.0), inputs)

    for one, two in on_1_and_2_threads(run):
        assert_rounding_apart(one, two)  # dA, dB: sums over rows, split by thread


def assert_rounding_apart(one, two):
    """Within the rounding of sums whose terms are split differently over the threads: float32 relative
    to the largest magnitude, or one bf16 ulp of it for bf16 results."""
    scale = one.abs().max().item()
    tolerance = (2**-8 if one.dtype == torch.bfloat16 else 1e-5) * scale
    torch.testing.assert_close(one.float(), two.float(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("trainable_weight", [False, True], ids=["frozen-lm-head", "trainable-lm-head"])
def test_token_logprobs(trainable_weight):
    n, h, v = 300, 64, 5000
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(n, h, generator=g).bfloat16(), (torch.randn(v, h, generator=g) / h**0.5).bfloat16()]
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = logprobs.IGNORE_INDEX

    def run():
        hidden, weight = base[0].clone().requires_grad_(), base[1].clone().requires_grad_(trainable_weight)
        lp, entropy = logprobs.token_logprobs(hidden, weight, targets, temperature=0.8, return_entropy=True)
        used = [hidden, weight] if trainable_weight else [hidden]
        grads = torch.autograd.grad(lp.sum() + 0.5 * entropy.sum(), used)
        return [lp.detach(), entropy.detach(), *grads]

    for one, two in on_1_and_2_threads(run):
        assert_rounding_apart(one, two)  # per-thread running statistics, merged at the end


def test_nf4_quantize_and_dequantize():
    weight = torch.randn(1024, 777, generator=torch.Generator().manual_seed(4)).bfloat16()

    def run():
        packed = nf4.quantize(weight, 64, double_quant=True)
        return [nf4.dequantize(packed)]

    for one, two in on_1_and_2_threads(run):
        assert torch.equal(one, two)
