"""A training step's CUDA ops queue without waiting for the GPU (torch.cuda.set_sync_debug_mode("error")
raises on any device-to-host synchronization): the LoRA linear on a dense and on an NF4 weight, the
packed logprobs with a trainable and a frozen lm_head (with entropy), and the NF4 dequantize under both
of its kernels, forward and backward (our kernels: tests/conftest.py forces them in `cuda` tests).
A host sync per layer stalls the CPU's run-ahead once per layer and breaks CUDA-graph capture. The MoE
ops have their own (tests/kernels/moe/test_moe_cuda.py, test_moe_nf4.py)."""

import pytest
import torch

import pykernels.nf4 as nf4
from conftest import requires_cuda
from cuda_sync import no_host_sync
from pykernels.logprobs import token_logprobs
from pykernels.lora import lora_linear

pytestmark = [requires_cuda, pytest.mark.cuda]


def randn(*shape, scale=1.0, dtype=torch.bfloat16, grad=False):
    g = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(*shape, generator=g) * scale).to(dtype).cuda().requires_grad_(grad)


@pytest.mark.parametrize("base", ["bf16", "nf4"])
@pytest.mark.parametrize("adapters", [torch.float32, torch.bfloat16], ids=str)
def test_lora_linear_forward_and_backward(base, adapters):
    x = randn(96, 256, grad=True)
    weight = randn(320, 256, scale=256**-0.5)
    if base == "nf4":
        weight = nf4.quantize(weight, 64, double_quant=True)
    a, b = randn(16, 256, scale=0.05, dtype=adapters, grad=True), randn(320, 16, scale=0.05, dtype=adapters, grad=True)
    bias = randn(320, grad=True)
    with no_host_sync():
        y = lora_linear(x, weight, a, b, 2.0, bias)
        grads = torch.autograd.grad(y.float().square().sum(), [x, a, b, bias])
    assert [g.shape for g in grads] == [x.shape, a.shape, b.shape, bias.shape]


@pytest.mark.parametrize("trainable", [True, False])
def test_token_logprobs_forward_and_backward(trainable):
    hidden = randn(200, 256, grad=True)
    weight = randn(1000, 256, scale=256**-0.5, grad=trainable)
    targets = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(1)).cuda()
    targets[::7] = -100  # ignore_index
    with no_host_sync():
        logprobs, entropy = token_logprobs(hidden, weight, targets, temperature=0.7, return_entropy=True)
        inputs = [hidden, weight] if trainable else [hidden]
        grads = torch.autograd.grad((logprobs - 0.1 * entropy).sum(), inputs)
    assert [g.shape for g in grads] == [t.shape for t in inputs]


@pytest.mark.parametrize("kernel", ["units", "warps"])  # PYKERNELS_NF4_DEQUANT (csrc/nf4/nf4.h)
def test_nf4_dequantize(kernel, monkeypatch):
    monkeypatch.setenv("PYKERNELS_NF4_DEQUANT", kernel)
    weight = nf4.quantize(randn(512, 4096 + 64), 64, double_quant=True)
    with no_host_sync():
        dense = nf4.dequantize(weight)
    assert dense.shape == (512, 4096 + 64)
