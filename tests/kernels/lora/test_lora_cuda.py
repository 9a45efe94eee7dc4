"""CUDA fused LoRA ops against an fp64 oracle, torch's own low-precision error, and the CPU ops.

Tolerance (STYLE.md #6, flash-attention's rule on the max abs error), for every output:
    max|cuda - fp64| <= 2 * max|torch_lowprec - fp64| + eps
torch_lowprec is the same math by plain torch matmuls in x's dtype on CUDA (PEFT's arithmetic).
eps is half an ulp of x's dtype at the output's largest magnitude: the fused pipeline rounds the
LoRA term before it enters the base GEMM, so it may round once more than torch does (an NF4 grad_x
sums its weight chunks in fp32 and is rounded once: tests/kernels/lora/test_lora.py checks that at K = 14336).
The CPU ops must agree with the CUDA ops within the sum of two budgets.
"""

import pytest
import torch
from cuda_oracle import check_outputs, error_budget

import pykernels.lora as lora
import pykernels.nf4 as nf4
from pykernels.nf4_format import nf4_code
from pykernels.reference import nf4 as reference
from conftest import requires_cuda
from pykernels import _C
from pykernels._extension import ops

pytestmark = [requires_cuda, pytest.mark.cuda]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
WEIGHTS = ["dense", "nf4", "nf4_double_quant"]
OUTPUTS = ["y", "xa", "grad_x", "grad_x_lora", "grad_A", "grad_B"]
SCALING = 2.0

# (M, K, N, r, bias, x_lora, fp32 LoRA weights). Covers r in {1, 8, 16, 64, 128, 256}, K and N in
# {769, 4096, 5125}, M in {1, 7, 1024} and every bias / x_lora pair. Sizes that are multiples of 8
# take the tensor-core GEMMs, odd ones the SIMT fallback; (K, N) = (5125, 4096) and (4096, 4096)
# split an NF4 weight into several dequantized chunks of 16 MiB (PYKERNELS_NF4_CHUNK_MIB=16; by
# default, at these token counts, a chunk grows to the whole weight: csrc/lora/nf4_chunks.h).
CASES = [
    (1, 769, 5125, 1, False, False, False),
    (7, 5125, 769, 8, True, False, True),
    (1024, 4096, 769, 16, False, True, False),
    (1024, 769, 4096, 64, True, True, True),
    (7, 4096, 4096, 128, False, False, True),
    (1024, 5125, 769, 256, True, False, False),
    (1, 5125, 4096, 64, False, True, True),
    (1024, 4096, 4096, 16, True, False, True),
    (1024, 769, 5125, 8, False, True, False),
]


def case_id(case):
    m, k, n, r, bias, x_lora, lora_fp32 = case
    flags = "".join(["-bias" if bias else "", "-xlora" if x_lora else "", "-fp32lora" if lora_fp32 else ""])
    return f"M{m}-K{k}-N{n}-r{r}{flags}"


def make_inputs(case, dtype, seed):
    """CPU tensors: x, weight, LoRA weights (B non-zero, unlike PEFT's init), bias, x_lora, grad_y."""
    m, k, n, r, has_bias, has_x_lora, lora_fp32 = case
    g = torch.Generator().manual_seed(seed)
    lora_dtype = torch.float32 if lora_fp32 else dtype
    fan_in = max(k, 1) ** -0.5

    def randn(*shape, scale=1.0, to=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(to)

    return {
        "x": randn(m, k),
        "weight": randn(n, k, scale=fan_in),
        "lora_A": randn(r, k, scale=fan_in, to=lora_dtype),
        "lora_B": randn(n, r, scale=r**-0.5, to=lora_dtype),
        "bias": randn(n) if has_bias else None,
        "x_lora": randn(m, k) if has_x_lora else None,
        "grad_y": randn(m, n),
    }


def nf4_args(w: nf4.NF4Weight):
    """(packed, absmax, blocksize) and the nested statistics as the NF4 ops take them."""
    absmax = w.absmax_q if w.double_quant else w.absmax
    return (w.packed, absmax, w.blocksize), (w.nested_absmax, w.nested_code, w.nested_offset, w.nested_blocksize)


def run_ops(t, weight, device, compute_grad_x=True):
    """Forward then backward through the pykernels ops on `device`; weight is a Tensor or NF4Weight."""
    t = {name: v.to(device) if v is not None else None for name, v in t.items()}
    x, a, b, bias, x_lora, dy = t["x"], t["lora_A"], t["lora_B"], t["bias"], t["x_lora"], t["grad_y"]
    weight = weight.to(device)
    if isinstance(weight, nf4.NF4Weight):
        quantized, nested = nf4_args(weight)
        n = weight.shape[0]
        y, xa = ops.lora_linear_nf4(x, *quantized, n, a, b, SCALING, bias, x_lora, *nested)
        grads = ops.lora_linear_nf4_backward(dy, x, *quantized, a, b, xa, SCALING, x_lora, compute_grad_x, *nested)
    else:
        y, xa = ops.lora_linear(x, weight, a, b, SCALING, bias, x_lora)
        grads = ops.lora_linear_backward(dy, x, weight, a, b, xa, SCALING, x_lora, compute_grad_x)
    return dict(zip(OUTPUTS, (y, xa, *grads)))


def torch_math(t, weight, dtype):
    """The forward and gradients by plain torch matmuls with every input cast to dtype, on CUDA."""
    x, a, b, dy = (t[name].cuda().to(dtype) for name in ("x", "lora_A", "lora_B", "grad_y"))
    w = weight.cuda().to(dtype)
    x_lora = x if t["x_lora"] is None else t["x_lora"].cuda().to(dtype)
    xa = x_lora @ a.T
    y = x @ w.T + SCALING * (xa @ b.T)
    if t["bias"] is not None:
        y = y + t["bias"].cuda().to(dtype)
    dxa = SCALING * (dy @ b)
    grad_x_lora = dxa @ a
    grad_x = dy @ w if t["x_lora"] is not None else dy @ w + grad_x_lora
    return {"y": y, "xa": xa, "grad_x": grad_x, "grad_x_lora": grad_x_lora if t["x_lora"] is not None else None,
            "grad_A": dxa.T @ x_lora, "grad_B": SCALING * (dy.T @ xa)}


def weight_for(kind, dense):
    """(weight given to the op, the dense weight it stands for)."""
    if kind == "dense":
        return dense, dense
    quantized = nf4.quantize(dense, 64, double_quant=kind == "nf4_double_quant")
    return quantized, nf4.dequantize(quantized, dense.dtype)


@pytest.mark.parametrize("lora_forward", ["extended_k", "cublas"])  # PYKERNELS_SM90_LORA: Hopper's default, and off
@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_matches_fp64_and_cpu(case, dtype, weight_kind, lora_forward, monkeypatch):
    monkeypatch.setenv("PYKERNELS_SM90_LORA", lora_forward)
    # NF4 weights: the default chunks (the whole weight here) on one side, 16 MiB chunks on the other
    monkeypatch.setenv("PYKERNELS_NF4_CHUNK_MIB", "16" if lora_forward == "cublas" else "")
    t = make_inputs(case, dtype, seed=CASES.index(case))
    weight, dense = weight_for(weight_kind, t["weight"])
    cuda = run_ops(t, weight, "cuda")
    cpu = run_ops(t, weight, "cpu")
    check_outputs(cuda, cpu, torch_math(t, dense, torch.float64), torch_math(t, dense, dtype), OUTPUTS,
                  HALF_ULP[dtype], depth=max(case[:3]))


@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("x_lora", [False, True])
def test_cuda_without_grad_x(x_lora, weight_kind):
    """compute_grad_x=False leaves grad_x empty and the other outputs bit-identical."""
    t = make_inputs((64, 4096, 1032, 16, False, x_lora, True), torch.bfloat16, seed=1)
    weight, _ = weight_for(weight_kind, t["weight"])
    full = run_ops(t, weight, "cuda")
    partial = run_ops(t, weight, "cuda", compute_grad_x=False)
    assert partial["grad_x"].shape == (0,)
    for name in ["y", "xa", "grad_x_lora", "grad_A", "grad_B"]:
        assert torch.equal(partial[name], full[name]), name


def dequantize_launches(fn) -> int:
    """NF4 dequantize kernels launched by fn()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sum(event.count for event in profile.key_averages() if "dequantize" in event.key)


def test_cuda_nf4_chunks_follow_the_rule(monkeypatch):
    """The QLoRA forward dequantizes W in as many chunks as csrc/lora/nf4_chunks.h says for this GPU:
    at 1024 tokens of a 4096 -> 14336 layer the whole weight at once by default (16 MiB chunks left
    each GEMM under half a wave on an H100), 7 chunks under PYKERNELS_NF4_CHUNK_MIB=16, the same y
    either way; a bad cap is named."""
    m, k, n = 1024, 4096, 14336
    t = make_inputs((m, k, n, 16, False, False, True), torch.bfloat16, seed=5)
    weight, _ = weight_for("nf4_double_quant", t["weight"])
    quantized, nested = nf4_args(weight.to("cuda"))
    x, a, b = t["x"].cuda(), t["lora_A"].cuda(), t["lora_B"].cuda()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ys = {}
    for setting in ("", "16"):
        monkeypatch.setenv("PYKERNELS_NF4_CHUNK_MIB", setting)

        def forward(setting=setting):
            ys[setting] = ops.lora_linear_nf4(x, *quantized, n, a, b, SCALING, None, None, *nested)[0]

        rows = _C.host_logic.lora_nf4_chunk_rows(n, k, m, 2, sms, setting)
        assert dequantize_launches(forward) == -(-n // rows), f"PYKERNELS_NF4_CHUNK_MIB={setting!r}"
    assert _C.host_logic.lora_nf4_chunk_rows(n, k, m, 2, 132, "16") == 2048  # the H100's 7 chunks
    torch.testing.assert_close(ys[""], ys["16"], rtol=2**-7, atol=1e-3)
    monkeypatch.setenv("PYKERNELS_NF4_CHUNK_MIB", "16MiB")
    with pytest.raises(ValueError, match="PYKERNELS_NF4_CHUNK_MIB must be a whole number of MiB"):
        ops.lora_linear_nf4(x, *quantized, n, a, b, SCALING, None, None, *nested)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

# bf16 only (the Hopper forward's dtype). r 21 with fp32 adapters and a bias fills one 64-deep k
# tile exactly (3 r + 1), r 22 needs two, bf16 adapters with r 64 and a bias three (2 r + 1); K
# 4104 leaves the base's last k tile 8 deep (TMA zero-fills the rest before U and V's tiles).
EXTENDED_K_CASES = [
    (1, 4096, 1032, 16, True, False, True),
    (1023, 4104, 4096, 21, True, True, True),
    (777, 768, 5128, 22, False, False, True),
    (1024, 4096, 4096, 64, True, False, False),
    (300, 2048, 2056, 8, False, True, False),
]


def ran_kernel(fn, name: str) -> bool:
    """Whether a CUDA kernel whose name contains `name` ran during fn()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return any(name in event.key for event in profile.key_averages())


def check_extended_k_forward(case, weight_kind, kernel: str, monkeypatch) -> tuple[dict, dict]:
    """The Hopper forward's default (PYKERNELS_SM90_LORA unset: extended_k), NF4 weights in several chunks at
    N 4096, within the cuBLAS path's budgets, and the GEMM whose kernel name holds `kernel` must have run.
    Returns the inputs and the CUDA outputs."""
    monkeypatch.delenv("PYKERNELS_SM90_LORA", raising=False)
    monkeypatch.setenv("PYKERNELS_NF4_CHUNK_MIB", "16")
    t = make_inputs(case, torch.bfloat16, seed=EXTENDED_K_CASES.index(case))
    weight, dense = weight_for(weight_kind, t["weight"])
    outputs = {}
    assert ran_kernel(lambda: outputs.update(run_ops(t, weight, "cuda")), kernel)
    check_outputs(outputs, run_ops(t, weight, "cpu"), torch_math(t, dense, torch.float64),
                  torch_math(t, dense, torch.bfloat16), OUTPUTS, HALF_ULP[torch.bfloat16], depth=max(case[:3]))
    return t, outputs


@pytest.mark.skipif(not HOPPER, reason="the extended-K GEMMs run on compute capability 9.0")
@pytest.mark.parametrize("weight_kind", ["dense", "nf4"])
@pytest.mark.parametrize("case", EXTENDED_K_CASES, ids=case_id)
def test_cuda_extended_k_on_the_plain_kernel_matches_fp64_and_cpu(case, weight_kind, monkeypatch):
    """PYKERNELS_SM90_DENSE=plain: the extended-K forward on CUTLASS's one-problem kernel
    (common/dense_gemm_plain_sm90.cu, extended_k_mainloop_sm90.cuh; the 128x256 tile it is built on forced)."""
    monkeypatch.setenv("PYKERNELS_SM90_DENSE", "plain")
    monkeypatch.setenv("PYKERNELS_SM90_TILE", "128x256")
    check_extended_k_forward(case, weight_kind, "ExtendedKMainloop", monkeypatch)


@pytest.mark.skipif(not HOPPER, reason="the extended-K GEMMs run on compute capability 9.0")
@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("case", EXTENDED_K_CASES, ids=case_id)
def test_cuda_extended_k_matches_fp64_and_cpu(case, weight_kind, monkeypatch):
    """One GEMM with the LoRA term and bias as extra K (lora/lora_extended_k.h, one group of the Hopper
    core), dense and NF4, and under PYKERNELS_SM90_LORA_GRAD_X=extended_k with a dense W and no x_lora the
    backward's grad_x = dy W + dxa A as one GEMM too, within the same budgets as the cuBLAS path; and it must
    be those GEMMs that ran."""
    monkeypatch.setenv("PYKERNELS_SM90_LORA_GRAD_X", "extended_k")
    t, outputs = check_extended_k_forward(case, weight_kind, "ExtendedKArrayMainloop", monkeypatch)
    if weight_kind == "dense" and t["x_lora"] is None:
        c = {name: v.cuda() if v is not None else None for name, v in t.items()}

        def backward():
            ops.lora_linear_backward(c["grad_y"], c["x"], c["weight"], c["lora_A"], c["lora_B"], outputs["xa"],
                                     SCALING, None, True)

        assert ran_kernel(backward, "ExtendedKArrayMainloop"), "the backward's grad_x is not one extra-K GEMM"


@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_rank_products_on_tensor_cores(case, weight_kind, monkeypatch):
    """PYKERNELS_LORA_RANK_GEMM=tensor_core: the rank products that meet an fp32 factor (xa, dxa, dB,
    dA and grad_x's dxa A) as bf16 pieces on the tensor-core GEMM (lora/lora_rank_pieces.h), every
    case (fp32 and bf16 adapters, x_lora, r 1 to 256), within the same budgets as the default path;
    and no SIMT rank GEMM ran."""
    monkeypatch.setenv("PYKERNELS_LORA_RANK_GEMM", "tensor_core")
    t = make_inputs(case, torch.bfloat16, seed=CASES.index(case))
    weight, dense = weight_for(weight_kind, t["weight"])
    outputs = {}
    assert not ran_kernel(lambda: outputs.update(run_ops(t, weight, "cuda")), "rank_gemm_kernel")
    check_outputs(outputs, run_ops(t, weight, "cpu"), torch_math(t, dense, torch.float64),
                  torch_math(t, dense, torch.bfloat16), OUTPUTS, HALF_ULP[torch.bfloat16], depth=max(case[:3]))


def mainloop_weight(q: nf4.NF4Weight) -> torch.Tensor:
    """The weight the NF4 mainloop GEMM multiplies by (nf4/nf4_gemm_sm90.h): each element
    bf16(bf16(code value) * absmax), the absmax decoded in fp32 when double-quantized."""
    codes = torch.stack([q.packed >> 4, q.packed & 0xF], dim=1).reshape(-1).long()  # high nibble first
    values = nf4_code()[codes].to(torch.bfloat16).float()
    absmax = q.absmax
    if absmax is None:
        absmax = reference.dequantize_absmax(q.absmax_q, q.nested_absmax, q.nested_offset, q.nested_code,
                                             q.nested_blocksize)
    return (values * absmax.repeat_interleave(q.blocksize)).to(torch.bfloat16).reshape(q.shape)


# K and N multiples of 64 and 8, as the kernel needs; M 1 and a partial 128-row tile; blocksize
# 64 (one k tile per block) and 256 (four).
NF4_MAINLOOP_CASES = [
    (1, 4096, 1032, 16, True, False, True),
    (1023, 4096, 4096, 16, False, True, True),
    (300, 768, 5128, 64, True, False, False),
]


@pytest.mark.skipif(not HOPPER, reason="the NF4 mainloop GEMM runs on compute capability 9.0")
@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("weight_kind", ["nf4", "nf4_double_quant"])
@pytest.mark.parametrize("case", NF4_MAINLOOP_CASES, ids=case_id)
def test_cuda_nf4_mainloop_forward(case, weight_kind, blocksize, monkeypatch):
    """PYKERNELS_SM90_NF4=mainloop: the QLoRA forward's x W^T with the codes decoded in the GEMM's
    mainloop (no dequantized W), within the usual budget of an fp64 oracle on the weight it
    multiplies by (within 1 ulp of bitsandbytes' per element: test_nf4_gemm_host.py); that kernel
    must be what ran. The backward is the default path's."""
    monkeypatch.setenv("PYKERNELS_SM90_NF4", "mainloop")
    t = make_inputs(case, torch.bfloat16, seed=NF4_MAINLOOP_CASES.index(case))
    weight = nf4.quantize(t["weight"], blocksize, double_quant=weight_kind == "nf4_double_quant")
    dense = mainloop_weight(weight)
    outputs = {}
    assert ran_kernel(lambda: outputs.update(run_ops(t, weight, "cuda")), "MixedInput")
    check_outputs(outputs, run_ops(t, weight, "cpu"), torch_math(t, dense, torch.float64),
                  torch_math(t, dense, torch.bfloat16), ["y", "xa"], HALF_ULP[torch.bfloat16], depth=max(case[:3]))


@pytest.mark.skipif(not HOPPER, reason="the NF4 mainloop GEMM runs on compute capability 9.0")
def test_cuda_nf4_mainloop_steps_aside(monkeypatch):
    """Shapes the kernel cannot take (K not a multiple of 64, blocksize 32) run the default path."""
    monkeypatch.setenv("PYKERNELS_SM90_NF4", "mainloop")
    for case, blocksize in [((64, 769, 1024, 8, False, False, True), 64),
                            ((64, 4096, 1024, 8, False, False, True), 32)]:
        t = make_inputs(case, torch.bfloat16, seed=4)
        weight = nf4.quantize(t["weight"], blocksize)
        outputs = run_ops(t, weight, "cuda")
        assert not ran_kernel(lambda t=t, weight=weight: run_ops(t, weight, "cuda"), "MixedInput")
        dense = nf4.dequantize(weight, torch.bfloat16)
        check_outputs(outputs, run_ops(t, weight, "cpu"), torch_math(t, dense, torch.float64),
                      torch_math(t, dense, torch.bfloat16), OUTPUTS, HALF_ULP[torch.bfloat16], depth=max(case[:3]))


@pytest.mark.parametrize("lora_forward", ["cublas", "extended_k"])
@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("weight_kind", ["dense", "nf4"])
def test_cuda_unaligned_views(offset, weight_kind, lora_forward, monkeypatch):
    """Tensors that start mid-allocation (sizes multiples of 8) take the SIMT fallback (and the
    extended-K forward steps aside for the default path: TMA needs 16-byte rows), same results."""
    monkeypatch.setenv("PYKERNELS_SM90_LORA", lora_forward)
    dtype = torch.bfloat16
    t = make_inputs((64, 4096, 1024, 16, True, False, False), dtype, seed=2)
    weight, dense = weight_for(weight_kind, t["weight"])

    def shifted(v):  # the same values, contiguous, `offset` elements into a larger allocation
        flat = torch.empty(v.numel() + offset, dtype=v.dtype, device="cuda")
        flat[offset:] = v.cuda().flatten()
        return flat[offset:].view(v.shape)

    cuda = run_ops({name: shifted(v) if v is not None else None for name, v in t.items()},
                   shifted(weight) if weight_kind == "dense" else weight, "cuda")
    exact, lowprec = torch_math(t, dense, torch.float64), torch_math(t, dense, dtype)
    for name in ["y", "xa", "grad_x", "grad_A", "grad_B"]:
        err = (cuda[name].double() - exact[name]).abs().max().item()
        assert err <= error_budget(exact[name], lowprec[name], HALF_ULP[dtype]), name


@pytest.mark.parametrize("weight_kind", WEIGHTS)
def test_cuda_no_tokens(weight_kind):
    """M = 0: empty y / grad_x, zero grad_A / grad_B, like the CPU ops."""
    t = make_inputs((0, 769, 83, 8, True, False, True), torch.bfloat16, seed=3)
    weight, _ = weight_for(weight_kind, t["weight"])
    cuda, cpu = run_ops(t, weight, "cuda"), run_ops(t, weight, "cpu")
    for name in OUTPUTS:
        assert (cuda[name].dtype, cuda[name].shape) == (cpu[name].dtype, cpu[name].shape), name
        assert torch.equal(cuda[name].cpu(), cpu[name]), name


def test_cuda_no_in_features():
    """K = 0 (dense weight): y = bias and grad_B = 0, the empty-product path of the GEMM."""
    t = make_inputs((5, 0, 83, 4, True, False, True), torch.float16, seed=4)
    cuda, cpu = run_ops(t, t["weight"], "cuda"), run_ops(t, t["weight"], "cpu")
    torch.testing.assert_close(cuda["y"].cpu(), t["bias"].expand(5, 83))
    for name in OUTPUTS:
        torch.testing.assert_close(cuda[name].cpu(), cpu[name], atol=1e-6, rtol=1e-6, msg=name)


def test_cuda_bad_inputs_name_the_tensor():
    t = {name: v.cuda() if v is not None else None
         for name, v in make_inputs((4, 64, 32, 8, False, False, True), torch.bfloat16, seed=5).items()}
    _, xa = ops.lora_linear(t["x"], t["weight"], t["lora_A"], t["lora_B"], 1.0)
    with pytest.raises(ValueError, match="grad_y must have x's dtype BFloat16, got Float"):
        ops.lora_linear_backward(t["grad_y"].float(), t["x"], t["weight"], t["lora_A"], t["lora_B"], xa, 1.0)
    with pytest.raises(ValueError, match="weight must be on cuda"):
        ops.lora_linear(t["x"], t["weight"].cpu(), t["lora_A"], t["lora_B"], 1.0)
    with pytest.raises(ValueError, match="xa must be on cuda"):
        ops.lora_linear_backward(t["grad_y"], t["x"], t["weight"], t["lora_A"], t["lora_B"], xa.cpu(), 1.0)


def test_cuda_opcheck():
    t = {name: v.cuda() if v is not None else None
         for name, v in make_inputs((7, 769, 83, 4, True, True, True), torch.bfloat16, seed=6).items()}
    x, w, a, b, bias, x_lora, dy = (t[name] for name in ("x", "weight", "lora_A", "lora_B", "bias", "x_lora",
                                                         "grad_y"))
    _, xa = ops.lora_linear(x, w, a, b, SCALING, bias, x_lora)
    torch.library.opcheck(ops.lora_linear, (x, w, a, b, SCALING, bias, x_lora))
    torch.library.opcheck(ops.lora_linear_backward, (dy, x, w, a, b, xa, SCALING, x_lora, True))
    torch.library.opcheck(ops.lora_linear_backward, (dy, x, w, a, b, xa, SCALING, None, False))
    quantized, nested = nf4_args(nf4.quantize(w, 64, double_quant=True))
    torch.library.opcheck(ops.lora_linear_nf4, (x, *quantized, 83, a, b, SCALING, bias, None, *nested))
    torch.library.opcheck(ops.lora_linear_nf4_backward,
                          (dy, x, *quantized, a, b, xa, SCALING, x_lora, True, *nested))


@pytest.mark.parametrize("weight_kind", ["dense", "nf4"])
def test_cuda_compile_forward_and_backward(weight_kind):
    torch._dynamo.reset()
    t = {name: v.cuda() if v is not None else None
         for name, v in make_inputs((7, 769, 83, 8, True, False, True), torch.bfloat16, seed=7).items()}
    weight, _ = weight_for(weight_kind, t["weight"])
    a, b = t["lora_A"].requires_grad_(), t["lora_B"].requires_grad_()
    x = t["x"].requires_grad_()

    def step(x, a, b):
        return lora.lora_linear(x, weight, a, b, SCALING, t["bias"]).float().square().sum()

    torch.compile(step, fullgraph=True)(x, a, b).backward()
    compiled = [v.grad.clone() for v in (x, a, b)]
    for v in (x, a, b):
        v.grad = None
    step(x, a, b).backward()
    for got, v in zip(compiled, (x, a, b)):
        torch.testing.assert_close(got, v.grad)
