"""pykernels.lora.lora_linear against fp64, the torch reference, and bad inputs."""

import pytest
import torch

import pykernels.lora as lora
import pykernels.nf4 as nf4
from conftest import requires_cuda
from pykernels._extension import ops
from pykernels.backend import kernels_mode

RANKS = [1, 8, 16, 24, 40, 64, 80, 128, 256]  # 24, 40, 80: every register-tile width of the CPU kernels
FEATURES = [(769, 83), (64, 5125)]  # (in, out): no divisibility anywhere
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make(in_features, out_features, r, dtype, lora_dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=g) / in_features ** 0.5).to(dtype)
    a = (torch.randn(r, in_features, generator=g) / in_features ** 0.5).to(lora_dtype).requires_grad_()
    b = (torch.randn(out_features, r, generator=g) * 0.1).to(lora_dtype).requires_grad_()
    bias_t = torch.randn(out_features, generator=g).to(dtype).requires_grad_() if bias else None
    return weight, a, b, bias_t


def fp64_reference(x, weight, a, b, scaling, bias):
    """Forward and gradients in float64 (the oracle)."""
    x64 = x.detach().double().requires_grad_()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    bias64 = bias.detach().double().requires_grad_() if bias is not None else None
    y = x64 @ weight.double().T + scaling * (x64 @ a64.T) @ b64.T
    if bias64 is not None:
        y = y + bias64
    return y, (x64, a64, b64, bias64)


def lowprec_torch(x, weight, a, b, scaling, bias):
    """What plain torch does in x's dtype (PEFT's arithmetic): the error budget."""
    x_ = x.detach().requires_grad_()
    a_, b_ = a.detach().to(x.dtype).requires_grad_(), b.detach().to(x.dtype).requires_grad_()
    bias_ = bias.detach().requires_grad_() if bias is not None else None
    y = torch.nn.functional.linear(x_, weight, bias_) + scaling * torch.nn.functional.linear(
        torch.nn.functional.linear(x_, a_), b_)
    return y, (x_, a_, b_, bias_)


def assert_within_torch_error(ours, lowprec, exact, name, eps=1e-5):
    err_ours = (ours.double() - exact).abs().max().item()
    err_torch = (lowprec.double() - exact).abs().max().item()
    assert err_ours <= 2 * err_torch + eps * max(1.0, exact.abs().max().item()), \
        f"{name}: |ours - fp64| = {err_ours:.3g} > 2 * |torch - fp64| = {2 * err_torch:.3g}"


def check_against_fp64(x, weight, a, b, scaling, bias, nf4_weight=None):
    dense = weight if nf4_weight is None else nf4.dequantize(nf4_weight, x.dtype)
    y = lora.lora_linear(x, nf4_weight if nf4_weight is not None else weight, a, b, scaling, bias)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    exact, exact_inputs = fp64_reference(x, dense, a, b, scaling, bias)
    exact.backward(grad_y.double())
    low, low_inputs = lowprec_torch(x, dense, a, b, scaling, bias)
    low.backward(grad_y)
    assert_within_torch_error(y, low, exact, "y")
    ours = [x.grad, a.grad, b.grad] + ([bias.grad] if bias is not None else [])
    for label, mine, torch_low, exact_t in zip(["dx", "dA", "dB", "dbias"], ours, low_inputs, exact_inputs):
        assert_within_torch_error(mine, torch_low.grad, exact_t.grad, label)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r", RANKS)
@pytest.mark.parametrize("features", FEATURES)
def test_dense_against_fp64(features, r, dtype, cpu_isa):
    weight, a, b, bias = make(*features, r, dtype)
    x = torch.randn(2, 7, features[0]).to(dtype).requires_grad_()  # 3-D
    check_against_fp64(x, weight, a, b, 2.0, bias)


def test_dense_bf16_weight_in_several_chunks_against_fp64(cpu_isa):
    """Without AVX-512 the base products run in fp32 on 8 MiB chunks of the weight, through one reused
    buffer: x W^T at K 2304 in chunks of 910 columns (the last 90) and dy W in chunks of 2097 (the
    last 207) must still be the whole product."""
    weight, a, b, bias = make(2304, 1000, 16, torch.bfloat16)
    x = torch.randn(5, 2304).bfloat16().requires_grad_()
    check_against_fp64(x, weight, a, b, 2.0, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("r", [1, 16, 256])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_against_fp64(r, dtype, double_quant, cpu_isa):
    weight, a, b, bias = make(769, 83, r, dtype)
    w4 = nf4.quantize(weight, 64, double_quant)
    x = torch.randn(37, 769).to(dtype).requires_grad_()
    check_against_fp64(x, weight, a, b, 0.5, bias, nf4_weight=w4)


def test_non_contiguous_x_and_no_bias():
    weight, a, b, _ = make(96, 40, 8, torch.float32, bias=False)
    base = torch.randn(96, 30)
    x = base.t().requires_grad_()  # [30, 96], non-contiguous
    check_against_fp64(x, weight, a, b, 1.0, None)


def test_no_in_features_is_the_empty_sum(cpu_isa):
    """K = 0: xa is zeros and y is the bias, on every CPU path. Twenty calls: the AVX-512 path once
    left xa unwritten (whatever the allocator returned), which a single call can miss."""
    weight, a, b, bias = make(0, 83, 4, torch.float16)
    x = torch.randn(5, 0, dtype=torch.float16)
    for _ in range(20):
        y, xa = ops.lora_linear(x, weight, a.detach(), b.detach(), 0.5, bias.detach(), None)
        assert torch.equal(xa, torch.zeros(5, 4)), xa
        assert torch.equal(y, bias.detach().expand(5, 83))


def test_lora_weights_in_the_activation_dtype():
    weight, a, b, bias = make(128, 64, 16, torch.bfloat16, lora_dtype=torch.bfloat16)
    check_against_fp64(torch.randn(9, 128).to(torch.bfloat16).requires_grad_(), weight, a, b, 2.0, bias)


def test_rank_r_intermediate_is_fp32():
    weight, a, b, _ = make(256, 32, 4, torch.bfloat16, bias=False)
    x = torch.randn(8, 256).to(torch.bfloat16)
    _, xa = ops.lora_linear(x, weight, a.detach(), b.detach(), 1.0)
    assert xa.dtype == torch.float32
    torch.testing.assert_close(xa.double(), x.double() @ a.detach().double().T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias_mode", ["trainable", "frozen", None])
@pytest.mark.parametrize("nf4_weight", [False, True])
def test_dropout_is_applied_to_the_lora_input_only(bias_mode, nf4_weight):
    """Values and every gradient (x through both paths, A, B, bias) against torch autograd on the same
    mask; with a trainable, a frozen and no bias, which move x_lora among the op's graph edges."""
    weight, a, b, bias = make(64, 32, 8, torch.float32, bias=bias_mode is not None)
    if bias_mode == "frozen":
        bias.requires_grad_(False)
    w4 = nf4.quantize(weight, 64, True) if nf4_weight else None
    dense = w4.dequantize(torch.float32) if nf4_weight else weight
    x = torch.randn(16, 64, requires_grad=True)
    torch.manual_seed(5)
    y = lora.lora_linear(x, w4 if nf4_weight else weight, a, b, 2.0, bias, dropout=0.5)
    x_, a_, b_ = (t.detach().clone().requires_grad_() for t in (x, a, b))
    torch.manual_seed(5)
    expected = x_ @ dense.T + 2.0 * (torch.nn.functional.dropout(x_, 0.5) @ a_.T) @ b_.T
    bias_ = bias.detach().clone().requires_grad_(bias_mode == "trainable") if bias_mode else None
    expected = expected + bias_ if bias_mode else expected
    torch.testing.assert_close(y.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    expected.backward(grad_y)
    pairs = {"x": (x, x_), "A": (a, a_), "B": (b, b_)}
    if bias_mode == "trainable":
        pairs["bias"] = (bias, bias_)
    for name, (mine, want) in pairs.items():
        torch.testing.assert_close(mine.grad, want.grad, atol=1e-4, rtol=1e-4, msg=f"grad of {name}")
    assert bias_mode != "frozen" or bias.grad is None


def test_frozen_lora_A_gets_no_gradient_and_B_the_right_one():
    """LoRA-FA freezes A: B's gradient (and x's) still match torch autograd; A gets none."""
    weight, a, b, bias = make(64, 32, 8, torch.float32)
    a.requires_grad_(False)
    x = torch.randn(16, 64, requires_grad=True)
    lora.lora_linear(x, weight, a, b, 2.0, bias).square().sum().backward()
    x_, b_ = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (x_ @ weight.T + bias.detach() + 2.0 * (x_ @ a.T) @ b_.T).square().sum().backward()
    assert a.grad is None
    torch.testing.assert_close(b.grad, b_.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(x.grad, x_.grad, atol=1e-3, rtol=1e-4)


def test_frozen_x_gets_no_gradient_and_the_adapters_do():
    weight, a, b, bias = make(64, 32, 8, torch.float32)
    x = torch.randn(16, 64)
    lora.lora_linear(x, weight, a, b, 2.0, bias, dropout=0.25).square().sum().backward()
    assert x.grad is None
    assert a.grad is not None and b.grad is not None and bias.grad is not None


def test_reference_switch_matches():
    weight, a, b, bias = make(769, 83, 16, torch.float32)
    x = torch.randn(5, 769)
    fused = lora.lora_linear(x, weight, a, b, 2.0, bias)
    with kernels_mode("reference"):
        reference = lora.lora_linear(x, weight, a, b, 2.0, bias)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nf4_weight", [False, True])
def test_opcheck(nf4_weight):
    weight, a, b, bias = make(96, 40, 8, torch.float32)
    x = torch.randn(7, 96)
    if nf4_weight:
        w = nf4.quantize(weight, 32, True)
        args = (x, w.packed, w.absmax_q, 32, 40, a.detach(), b.detach(), 2.0, bias.detach(), None, w.nested_absmax,
                w.nested_code, w.nested_offset, 256)
        torch.library.opcheck(ops.lora_linear_nf4, args)
    else:
        torch.library.opcheck(ops.lora_linear, (x, weight, a.detach(), b.detach(), 2.0, bias.detach(), x.clone()))
        torch.library.opcheck(ops.lora_linear, (x, weight, a.detach(), b.detach(), 2.0, None, None))


@pytest.mark.parametrize("nf4_weight", [False, True])
def test_compile_forward_and_backward(nf4_weight):
    torch._dynamo.reset()
    weight, a, b, bias = make(96, 40, 8, torch.float32)
    w = nf4.quantize(weight, 32) if nf4_weight else weight

    def step(x, a, b):
        return lora.lora_linear(x, w, a, b, 2.0, bias).square().sum()

    x = torch.randn(7, 96, requires_grad=True)
    loss = torch.compile(step, fullgraph=True)(x, a, b)
    loss.backward()
    grads = [t.grad.clone() for t in (x, a, b)]
    for t in (x, a, b):
        t.grad = None
    step(x, a, b).backward()
    for got, t in zip(grads, (x, a, b)):
        torch.testing.assert_close(got, t.grad)


def test_bad_inputs_name_the_tensor():
    weight, a, b, bias = make(64, 32, 8, torch.float32)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"lora_B must have shape \(out_features, r\) = \(32, 8\), got \(8, 32\)"):
        lora.lora_linear(x, weight, a, b.detach().t().contiguous(), 1.0)
    with pytest.raises(ValueError, match=r"lora_B must have shape \(out_features, r\) = \(32, 8\), got \(32, 4\)"):
        lora.lora_linear(x, weight, a, b.detach()[:, :4].contiguous(), 1.0)
    with pytest.raises(ValueError, match="weight must have x's dtype BFloat16, got Float"):
        lora.lora_linear(x.bfloat16(), weight, a, b, 1.0)
    with pytest.raises(ValueError, match="lora_B must have lora_A's dtype Float, got Half"):
        lora.lora_linear(x, weight, a, b.detach().half(), 1.0)
    with pytest.raises(ValueError, match="lora_A and lora_B must be float32 or x's dtype BFloat16, got Half"):
        lora.lora_linear(x.bfloat16(), weight.bfloat16(), a.detach().half(), b.detach().half(), 1.0)
    with pytest.raises(ValueError, match=r"weight must have shape \(out_features, in_features\) = \(32, 64\)"):
        lora.lora_linear(x, weight[:, :63].contiguous(), a, b, 1.0)
    with pytest.raises(ValueError, match=r"bias must have shape \(out_features,\) = \(32,\)"):
        lora.lora_linear(x, weight, a, b, 1.0, bias=torch.zeros(31))
    with pytest.raises(ValueError, match="weight must be frozen"):
        lora.lora_linear(x, weight.clone().requires_grad_(), a, b, 1.0)
    with pytest.raises(ValueError, match="dropout must be in"):
        lora.lora_linear(x, weight, a, b, 1.0, dropout=1.0)


@pytest.mark.parametrize("nf4_weight", [False, True])
def test_many_rows_run_multithreaded_with_trainable_inputs(nf4_weight, cpu_isa):
    """Chunks run on at::parallel_for workers, which must not re-enter autograd (a real bug once)."""
    weight, a, b, bias = make(128, 64, 8, torch.float32)
    x = torch.randn(3000, 128, requires_grad=True)
    check_against_fp64(x, weight, a, b, 2.0, bias, nf4_weight=nf4.quantize(weight, 64) if nf4_weight else None)


# ---------------------------------------------------------------- every device: fp32 LoRA path, layouts
DEVICES = ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]


@pytest.mark.parametrize(("device", "rank_gemm"), [
    ("cpu", "simt"), pytest.param("cuda", "simt", marks=[requires_cuda, pytest.mark.cuda]),
    pytest.param("cuda", "tensor_core", marks=[requires_cuda, pytest.mark.cuda])])  # PYKERNELS_LORA_RANK_GEMM
def test_fp32_lora_weights_and_intermediates_stay_fp32(device, rank_gemm, monkeypatch):
    """bf16 x with fp32 A / B (PEFT's training setup): xa, dA and dB are fp32 outputs of fp32 math
    on fp32 A, B, xa and dxa (on CUDA also as three bf16 pieces each, lora/lora_rank_pieces.h). The
    tolerance is ~20x below what rounding A, B, xa or dxa to bf16 costs (a relative ~2^-9 per
    element), so a bf16 cast anywhere on that path fails it."""
    monkeypatch.setenv("PYKERNELS_LORA_RANK_GEMM", rank_gemm)
    m, k, n, r = 37, 769, 83, 16  # odd sizes: no vector path on any device
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g).bfloat16()
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    a = torch.randn(r, k, generator=g) / k ** 0.5
    b = torch.randn(n, r, generator=g) / r ** 0.5
    dy = torch.randn(m, n, generator=g).bfloat16()
    scaling = 2.0
    on = [t.to(device) for t in (x, weight, a, b, dy)]
    _, xa = ops.lora_linear(*on[:4], scaling)
    _, _, grad_a, grad_b = ops.lora_linear_backward(on[4], on[0], on[1], on[2], on[3], xa, scaling)
    x64, a64, b64, dy64 = x.double(), a.double(), b.double(), dy.double()
    xa64 = x64 @ a64.T
    dxa64 = scaling * dy64 @ b64
    for name, ours, exact in (("xa", xa, xa64), ("grad_A", grad_a, dxa64.T @ x64),
                              ("grad_B", grad_b, scaling * dy64.T @ xa64)):
        assert ours.dtype == torch.float32, name
        err = (ours.cpu().double() - exact).abs().max().item()
        bf16_cost = 2.0**-9 * exact.abs().max().item()  # one bf16 rounding of an operand, per element
        assert err <= bf16_cost / 20, f"{name}: |ours - fp64| = {err:.3g}, a bf16 operand costs ~{bf16_cost:.3g}"


def odd_layouts(x):
    """x [M, K] as a transposed (non-contiguous) view and as a view one element into its storage."""
    transposed = x.t().contiguous().t()
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    flat[1:] = x.flatten()
    return {"transposed": transposed, "offset1": flat[1:].view(x.shape)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_kind", ["dense", "nf4"])
@pytest.mark.parametrize("layout", ["transposed", "offset1"])
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_odd_sizes_and_misaligned_views(layout, weight_kind, lora_dtype, device):
    weight, a, b, bias = make(83, 769, 7, torch.bfloat16, lora_dtype=lora_dtype, seed=3)
    weight, bias = weight.to(device), bias.detach().to(device).requires_grad_()
    a, b = a.detach().to(device).requires_grad_(), b.detach().to(device).requires_grad_()
    x = odd_layouts(torch.randn(5, 83).bfloat16().to(device))[layout].requires_grad_()
    w4 = nf4.quantize(weight, 64) if weight_kind == "nf4" else None
    check_against_fp64(x, weight, a, b, 2.0, bias, nf4_weight=w4)


@pytest.mark.parametrize("device", DEVICES)
def test_nf4_grad_x_is_rounded_once_across_weight_chunks(device, monkeypatch):
    """grad_x = dy W with W [4096, 14336] in NF4: the op dequantizes W in chunks of rows (15 on
    CPU, 8 on CUDA under PYKERNELS_NF4_CHUNK_MIB=16, which at 4 tokens would otherwise take the whole
    weight) and must sum the chunks in fp32 and round once, like one bf16 GEMM; rounding the running
    sum to bf16 after every chunk costs ~sqrt(chunks / 2) times torch's error."""
    monkeypatch.setenv("PYKERNELS_NF4_CHUNK_MIB", "16")
    m, k, n, r = 4, 14336, 4096, 8
    g = torch.Generator().manual_seed(12)
    w4 = nf4.quantize((torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(device), 64)
    dense = nf4.dequantize(w4, torch.bfloat16)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    dy = torch.randn(m, n, generator=g).bfloat16().to(device)
    a = torch.randn(r, k, generator=g, device="cpu").to(device) * k ** -0.5
    b = torch.zeros(n, r, device=device)  # PEFT's init: grad_x is the base product alone
    xa = torch.zeros(m, r, device=device)
    absmax = w4.absmax
    grad_x, _, _, _ = ops.lora_linear_nf4_backward(dy, x, w4.packed, absmax, 64, a, b, xa, 1.0, None, True,
                                                   None, None, None, 256)
    exact = sum(dy[:, c:c + 1024].double() @ dense[c:c + 1024].double() for c in range(0, n, 1024))
    err_ours = (grad_x.double() - exact).abs().mean().item()
    err_torch = ((dy @ dense).double() - exact).abs().mean().item()
    assert err_ours <= 2 * err_torch, f"mean |ours - fp64| = {err_ours:.3g} > 2 * torch's {err_torch:.3g}"
