"""The CUDA ops at the sizes users train at, forward and backward, against fp32 torch on the GPU.

Small odd shapes (the other *_cuda.py files) find index bugs; these find what only size shows:
grids past 65535 blocks, 32-bit offsets, workspaces, the persistent scheduler walking thousands of
tiles over 128 experts. Shapes from the issue that set the Hopper targets: Qwen3-30B-A3B's experts
(E=128, top-8, H=2048, I=768) at T=16384 with and without LoRA r=16 on them; a 151936-token lm_head
at H=4096, N=16384; LoRA r=16 on a 4096x14336 projection at T=8192. All bf16.

On a Hopper GPU every case runs four times: on the default tiles of the sm_90a GEMM core and of the
lm_head GEMMs, on each tile forced (PYKERNELS_SM90_TILE, common/sm90_tiles.h;
PYKERNELS_SM90_LOGPROBS_TILE, logprobs/logprobs_sm90.h) and with the Hopper kernels switched off
(PYKERNELS_SM90=0; all read on every call), so every kernel a user can pick is checked at these sizes
in one run; the LoRA case also runs under the Hopper paths off the defaults (PYKERNELS_SM90_LORA=cublas,
PYKERNELS_SM90_LORA_GRAD_X=extended_k, and PYKERNELS_SM90_NF4=mainloop on its NF4 form).
Elsewhere the other runs would repeat the first and are skipped.

Bound: max|ours - fp32| <= TOLERANCE * max|fp32| per output. Our outputs round intermediates to
bf16 where the fp32 oracle does not (an expert MLP's gate_up rows, the LoRA activations), which
costs a few bf16 ulps (2^-8 relative) of the largest value; a wrong tile or index costs O(1).
"""

import pytest
import torch

from conftest import requires_cuda
from pykernels import backend, logprobs, lora, moe, nf4
from pykernels.reference import moe as reference_moe

pytestmark = [requires_cuda, pytest.mark.cuda]

TOLERANCE = 2.5e-2
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# Each Hopper tile forced (the defaults pick by shape, common/sm90_tiles.h, or are 256x128,
# logprobs/logprobs_sm90.h), paired: (the GEMM core's PYKERNELS_SM90_TILE, the lm_head GEMMs'
# PYKERNELS_SM90_LOGPROBS_TILE).
OTHER_TILES = {"sm90_tiles_128x128_128x128": ("128x128", "128x128"),
               "sm90_tiles_128x256_256x128": ("128x256", "256x128")}


@pytest.fixture(params=["sm90_core", *OTHER_TILES, "sm80_kernels"])
def gemm_generation(request, monkeypatch):
    if request.param != "sm90_core" and not HOPPER:
        pytest.skip("not a Hopper GPU: the sm80 kernels already ran")
    if request.param == "sm80_kernels":
        monkeypatch.setenv("PYKERNELS_SM90", "0")
    elif request.param in OTHER_TILES:
        core, lm_head = OTHER_TILES[request.param]
        monkeypatch.setenv("PYKERNELS_SM90_TILE", core)
        monkeypatch.setenv("PYKERNELS_SM90_LOGPROBS_TILE", lm_head)
    return request.param


def assert_close(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert err <= TOLERANCE * scale + 1e-6, f"{name}: max|ours - fp32| = {err:.3e} > {TOLERANCE} * {scale:.3e}"


def leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(True)


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora_r16"])
def test_moe_experts_qwen3_30b_a3b_t16384(gemm_generation, with_lora):
    tokens, hidden_size, inter, experts, top_k, rank = 16384, 2048, 768, 128, 8, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    hidden = torch.randn(tokens, hidden_size, device=dev, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden_size, device=dev, generator=g) * hidden_size**-0.5
    down = torch.randn(experts, hidden_size, inter, device=dev, generator=g) * inter**-0.5
    logits = torch.randn(tokens, experts, device=dev, generator=g)
    weights, index = torch.softmax(logits, -1).topk(top_k, dim=-1)
    factors = {}
    if with_lora:
        shapes = {"gate_up_proj": (2 * inter, hidden_size), "down_proj": (hidden_size, inter)}
        for name, (out_f, in_f) in shapes.items():
            factors[name] = (torch.randn(rank * experts, in_f, device=dev, generator=g) * in_f**-0.5,
                             torch.randn(out_f, rank * experts, device=dev, generator=g) * 0.1)

    def run(dtype, ours):
        h, w = leaf(hidden, dtype), leaf(weights, dtype)
        lora_leaves = {name: (leaf(a, dtype), leaf(b, dtype)) for name, (a, b) in factors.items()}
        adapters = {name: reference_moe.LoRAFactors(a, b, 2.0) for name, (a, b) in lora_leaves.items()}
        args = (h, index, w, gate_up.to(dtype), down.to(dtype))
        if ours:
            with backend.forced("moe", "ours"):
                out = moe.experts_forward(*args, lora=adapters or None)
        else:
            out = reference_moe.experts_forward(*args, "silu", adapters)
        out.backward(torch.ones_like(out) / tokens**0.5)
        grads = {"hidden": h.grad, "top_k_weights": w.grad}
        for name, (a, b) in lora_leaves.items():
            grads[f"{name}.lora_a"], grads[f"{name}.lora_b"] = a.grad, b.grad
        return {"out": out.detach(), **grads}

    got, want = run(torch.bfloat16, ours=True), run(torch.float32, ours=False)
    for name in want:
        assert_close(name, got[name], want[name])


def test_logprobs_vocab_151936_n16384(gemm_generation):
    n, h, vocab, chunk = 16384, 4096, 151936, 2048
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(n, h, device="cuda", generator=g)
    weight = torch.randn(vocab, h, device="cuda", generator=g) * h**-0.5
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    targets[::97] = -100  # ignored positions
    grad_lp, grad_ent = (torch.randn(n, device="cuda", generator=g) for _ in range(2))

    hb, wb = leaf(hidden, torch.bfloat16), leaf(weight, torch.bfloat16)
    with backend.forced("logprobs", "ours"):
        lp, ent = logprobs.token_logprobs(hb, wb, targets, temperature=0.7, return_entropy=True)
    (lp * grad_lp + ent * grad_ent).sum().backward()

    # fp32 oracle a token chunk at a time (the full [N, V] fp32 logits would take 10 GB)
    w32 = leaf(weight, torch.float32)
    want_lp, want_ent, want_dh = [], [], []
    for t0 in range(0, n, chunk):
        h32 = leaf(hidden[t0:t0 + chunk], torch.float32)
        logp = torch.log_softmax(h32 @ w32.T / 0.7, dim=-1)
        tgt = targets[t0:t0 + chunk]
        keep = tgt != -100
        picked = torch.where(keep, logp.gather(1, tgt.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        entropy = torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)
        (picked * grad_lp[t0:t0 + chunk] + entropy * grad_ent[t0:t0 + chunk]).sum().backward()
        want_lp.append(picked.detach())
        want_ent.append(entropy.detach())
        want_dh.append(h32.grad)
    assert_close("logprobs", lp, torch.cat(want_lp))
    assert_close("entropy", ent, torch.cat(want_ent))
    assert_close("grad_hidden", hb.grad, torch.cat(want_dh))
    assert_close("grad_weight", wb.grad, w32.grad)


def check_lora_4096x14336_r16_t8192(quantize: bool):
    """lora_linear forward and backward at the real shape against fp32 torch: on a bf16 weight, or
    on its NF4 (double-quantized) form against the fp32 dequantized weight."""
    tokens, in_f, out_f, rank = 8192, 4096, 14336, 16
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, in_f, device="cuda", generator=g)
    weight = torch.randn(out_f, in_f, device="cuda", generator=g) * in_f**-0.5
    a = torch.randn(rank, in_f, device="cuda", generator=g) * in_f**-0.5
    b = torch.randn(out_f, rank, device="cuda", generator=g) * 0.1
    grad_y = torch.randn(tokens, out_f, device="cuda", generator=g)
    base = weight.to(torch.bfloat16)
    if quantize:
        base = nf4.quantize(base, 64, double_quant=True)
        weight = nf4.dequantize(base, torch.float32)

    xb, ab, bb = leaf(x, torch.bfloat16), leaf(a, torch.float32), leaf(b, torch.float32)  # fp32 adapter, as PEFT
    with backend.forced("lora", "ours"):
        y = lora.lora_linear(xb, base, ab, bb, 2.0)
    y.backward(grad_y.to(y.dtype))

    x32, a32, b32 = leaf(x, torch.float32), leaf(a, torch.float32), leaf(b, torch.float32)
    want = x32 @ weight.T + 2.0 * (x32 @ a32.T) @ b32.T
    want.backward(grad_y)
    assert_close("y", y, want.detach())
    assert_close("grad_x", xb.grad, x32.grad)
    assert_close("grad_lora_a", ab.grad, a32.grad)
    assert_close("grad_lora_b", bb.grad, b32.grad)


def test_lora_4096x14336_r16_t8192(gemm_generation):
    check_lora_4096x14336_r16_t8192(quantize=False)


# The Hopper paths off the defaults (read on every call): the LoRA forward on cuBLAS, grad_x as extra
# K of the base GEMM (lora/lora_extended_k.h), and QLoRA's NF4 decoded in the GEMM's mainloop
# (nf4/nf4_gemm_sm90.h).
OPT_IN_PATHS = {"cublas_forward": ("PYKERNELS_SM90_LORA", "cublas", False),
                "extended_k_grad_x": ("PYKERNELS_SM90_LORA_GRAD_X", "extended_k", False),
                "nf4_mainloop": ("PYKERNELS_SM90_NF4", "mainloop", True)}


@pytest.mark.skipif(not HOPPER, reason="the opt-in Hopper paths run on compute capability 9.0")
@pytest.mark.parametrize("path", OPT_IN_PATHS)
def test_lora_4096x14336_r16_t8192_opt_in_hopper_paths(path, monkeypatch):
    variable, value, quantize = OPT_IN_PATHS[path]
    monkeypatch.setenv(variable, value)
    check_lora_4096x14336_r16_t8192(quantize)
