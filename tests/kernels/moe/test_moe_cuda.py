"""CUDA grouped MoE ops against an fp64 oracle, torch's own low-precision error, and the CPU ops.

Tolerance (STYLE.md #6), for the output and every gradient:
    max|cuda - fp64| <= 2 * max|torch_lowprec - fp64| + eps
fp64 is pykernels.reference's grouped linear on fp64 copies (itself checked assignment by
assignment in test_moe_ops.py); torch_lowprec is the same math by plain torch in x's dtype on CUDA.
eps is one ulp of x's dtype at the output's largest magnitude: the kernels round u = x A^T and
v = dy B to x's dtype like torch does, but also each gated slot row before the per-token sum (as
the CPU's bf16 path does). The CPU ops must agree with the CUDA ops within twice that budget.
"""

import pytest
import torch
from cuda_oracle import check_outputs
from cuda_sync import no_host_sync
from test_moe_ops import FLAGS, make_routing

from conftest import requires_cuda
from pykernels import _C, moe
from pykernels._extension import ops
from pykernels.reference import moe as reference

pytestmark = [requires_cuda, pytest.mark.cuda]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
SCALING = 0.5
OUTPUTS = ["y", "grad_x", "grad_weight", "grad_gates", "grad_lora_a", "grad_lora_b"]
FLAG_IDS = [f"in{int(a)}-out{int(b)}-gates{int(c)}-lora{int(d)}" for a, b, c, d in FLAGS]

# (tokens, top_k, experts, in, out, rank). Multiples of 8 take the tensor-core kernels (r = 5
# pads the LoRA activations to 8 columns), odd sizes the SIMT kernels; 300 * 4 slots over 8
# experts give experts several 128-row tiles; 512 experts for 160 slots leave most of them empty.
SHAPES = [
    (37, 3, 5, 33, 70, 1),
    (300, 4, 8, 256, 128, 5),
    (40, 4, 512, 64, 96, 16),
    (7, 1, 1, 24, 40, 8),
]
BIG_ODD = (64, 8, 16, 769, 5125, 8)  # one flag combination: the CPU side is slow at this size


def shape_id(shape):
    return "T{}-k{}-E{}-in{}-out{}-r{}".format(*shape)


def make_case(shape, grouped_in, with_gates, with_lora, dtype, seed=0):
    """CPU inputs: routing (with dropped ids), x, weight, gates, LoRA factors, grad_y."""
    tokens, top_k, experts, in_f, out_f, rank = shape
    g = torch.Generator().manual_seed(seed)
    idx = make_routing(tokens, top_k, experts, seed=seed, dropped=2 if tokens * top_k > 8 else 0)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(dtype)

    slots = tokens * top_k
    case = {
        "idx": idx,
        "top_k": top_k,
        "x": randn(slots if grouped_in else tokens, in_f),
        "weight": randn(experts, out_f, in_f, scale=in_f**-0.5),
        "gates": torch.rand(tokens, top_k, generator=g).to(dtype) if with_gates else None,
        "lora_a": randn(rank * experts, in_f, scale=in_f**-0.5) if with_lora else None,
        "lora_b": randn(out_f, rank * experts, scale=rank**-0.5) if with_lora else None,
    }
    return case


def grad_rows(case, grouped_out):
    slots = case["idx"].numel()
    return slots // case["top_k"] if case["gates"] is not None and not grouped_out else slots


def run_ops(case, grouped_in, grouped_out, dy, device, flags=(True, True, True, True)):
    """Forward then backward through the pykernels ops on `device`."""
    def to(v):
        return v.to(device) if v is not None else None

    routing = [t.to(device) for t in ops.moe_sort_tokens(to(case["idx"]), case["weight"].shape[0])]
    args = (to(case["x"]), to(case["weight"]), *routing, case["top_k"], grouped_in, grouped_out, to(case["gates"]),
            to(case["lora_a"]), to(case["lora_b"]), SCALING)
    y = ops.moe_grouped_linear(*args)
    grads = ops.moe_grouped_linear_backward(to(dy), *args, *flags)
    return dict(zip(OUTPUTS, (y, *grads)))


def torch_math(case, grouped_in, grouped_out, dy, dtype):
    """The output and every gradient by autograd through plain torch in `dtype` on CUDA; None for
    inputs that are absent. fp64: pykernels.reference (the oracle); otherwise the same math with
    torch's matmuls in the low-precision dtype."""
    routing = reference.sort_tokens(case["idx"].cuda(), case["weight"].shape[0])
    leaves = {name: case[name].cuda().to(dtype).requires_grad_() if case[name] is not None else None
              for name in ("x", "weight", "gates", "lora_a", "lora_b")}
    lora = (moe.LoRAFactors(leaves["lora_a"], leaves["lora_b"], SCALING) if leaves["lora_a"] is not None else None)
    if dtype == torch.float64:
        y = reference.grouped_linear(leaves["x"], leaves["weight"], *routing, case["top_k"], grouped_in, grouped_out,
                                     leaves["gates"], lora)
    else:
        y = lowprec_grouped_linear(leaves["x"], leaves["weight"], routing, case["top_k"], grouped_in, grouped_out,
                                   leaves["gates"], lora)
    used = [v for v in leaves.values() if v is not None]
    grads = iter(torch.autograd.grad(y, used, dy.cuda().to(dtype)))
    out = {"y": y.detach()}
    for name, key in [("x", "grad_x"), ("weight", "grad_weight"), ("gates", "grad_gates"), ("lora_a", "grad_lora_a"),
                      ("lora_b", "grad_lora_b")]:
        out[key] = next(grads) if leaves[name] is not None else None
    return out


def lowprec_grouped_linear(x, weight, routing, top_k, grouped_in, grouped_out, gates, lora):
    """reference.grouped_linear with every product in x's dtype (torch's low-precision arithmetic)."""
    _, sorted_token_idx, expert_offsets = routing
    experts, out_f, _ = weight.shape
    rows = x if grouped_in else x.index_select(0, sorted_token_idx // top_k)
    offsets = expert_offsets.tolist()
    pieces = []
    for e in range(experts):
        xe = rows[offsets[e]:offsets[e + 1]]
        if xe.shape[0]:
            ye = xe @ weight[e].T
            if lora is not None:
                a_e, b_e = lora.expert(e, experts)
                ye = ye + (lora.scaling * (xe @ a_e.T)) @ b_e.T
            pieces.append(ye)
    pieces.append(rows.new_zeros(rows.shape[0] - offsets[-1], out_f))
    y = torch.cat(pieces)
    if gates is not None:
        y = y * gates.reshape(-1).index_select(0, sorted_token_idx).unsqueeze(1)
    if not grouped_out:
        y = torch.zeros_like(y).index_copy(0, sorted_token_idx, y)
        if gates is not None:
            y = y.view(-1, top_k, out_f).sum(1)
    return y


def check_against_oracles(case, grouped_in, grouped_out, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    dy = torch.randn(grad_rows(case, grouped_out), case["weight"].shape[1], generator=g).to(dtype)
    cuda = run_ops(case, grouped_in, grouped_out, dy, "cuda")
    cpu = run_ops(case, grouped_in, grouped_out, dy, "cpu")
    exact = torch_math(case, grouped_in, grouped_out, dy, torch.float64)
    lowprec = torch_math(case, grouped_in, grouped_out, dy, dtype)
    depth = max(case["idx"].numel(), *case["weight"].shape[1:])  # slots (weight grads), in and out features
    check_outputs(cuda, cpu, exact, lowprec, OUTPUTS, ULP[dtype], depth)


# ---------------------------------------------------------------- sort_tokens
@pytest.mark.parametrize(("tokens", "top_k", "experts", "dropped"),
                         [(1, 1, 1, 0), (13, 2, 4, 2), (64, 8, 128, 3), (5, 16, 512, 1), (0, 2, 3, 0),
                          (2000, 16, 512, 9), (4096, 8, 128, 0), (300, 4, 4000, 5)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_sort_tokens_equals_cpu(tokens, top_k, experts, dropped, index_dtype):
    """Bit-identical to the CPU op: E = 1, E = 512 with k = 16 (most experts empty), several warp
    chunks, E = 4000 (cursors in global memory), dropped ids on both sides of [0, E)."""
    idx = make_routing(tokens, top_k, experts, dropped=dropped)
    if dropped:
        idx.view(-1)[-1] = -1
    idx = idx.to(index_dtype)
    ours = ops.moe_sort_tokens(idx.cuda(), experts)
    for got, want in zip(ours, ops.moe_sort_tokens(idx, experts)):
        assert got.is_cuda and got.dtype == torch.int64
        assert torch.equal(got.cpu(), want)


def test_sort_tokens_non_contiguous_index():
    idx = make_routing(50, 8, 16, dropped=2)
    strided = idx.cuda().t().contiguous().t()  # same values, column-major
    for got, want in zip(ops.moe_sort_tokens(strided, 16), ops.moe_sort_tokens(idx, 16)):
        assert torch.equal(got.cpu(), want)


# ---------------------------------------------------------------- grouped_linear
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS, ids=FLAG_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_grouped_linear_matches_fp64_and_cpu(shape, grouped_in, grouped_out, with_gates, with_lora, dtype):
    case = make_case(shape, grouped_in, with_gates, with_lora, dtype, seed=SHAPES.index(shape))
    check_against_oracles(case, grouped_in, grouped_out, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_linear_big_odd_sizes(dtype):
    """in = 769, out = 5125: the SIMT kernels, many column tiles, summed gated rows with LoRA."""
    case = make_case(BIG_ODD, False, True, True, dtype, seed=7)
    check_against_oracles(case, False, False, dtype)


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="the Hopper GEMM core's tiles run on compute capability 9.0")
@pytest.mark.parametrize("tile", _C.host_logic.gemm_sm90_tiles)  # common/sm90_tiles.h
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], (7, 1, 1, 24, 40, 8)], ids=shape_id)
def test_every_hopper_tile_matches_fp64_and_cpu(shape, tile, monkeypatch):
    """Each tile of the Hopper GEMM core (PYKERNELS_SM90_TILE, read on every call) on bf16 shapes it
    takes, gated sums with LoRA: experts with several 128-row tiles (300 tokens x 4 over 8), most of
    512 experts empty (a 2-CTA cluster over groups of 0 or 1 rows), one 7-row expert."""
    monkeypatch.setenv("PYKERNELS_SM90_TILE", tile)
    case = make_case(shape, False, True, True, torch.bfloat16, seed=3)
    check_against_oracles(case, False, False, torch.bfloat16)


@pytest.mark.skipif(not HOPPER, reason="the Hopper GEMM core runs on compute capability 9.0")
@pytest.mark.parametrize("moe_lora", ["extra_k", "separate"])  # PYKERNELS_SM90_MOE_LORA, moe/moe.h
@pytest.mark.parametrize("shape", [SHAPES[1], (7, 1, 1, 24, 40, 8)], ids=shape_id)
def test_hopper_experts_lora_both_ways(shape, moe_lora, monkeypatch):
    """The experts' LoRA products as extra K of the base GEMM (the default; 24 features: the base's
    only k tile partial, then the LoRA's) and as their own GEMMs, forward and backward."""
    monkeypatch.setenv("PYKERNELS_SM90_MOE_LORA", moe_lora)
    case = make_case(shape, False, True, True, torch.bfloat16, seed=3)
    check_against_oracles(case, False, False, torch.bfloat16)


LORA_FLAGS = [flags for flags in FLAGS if flags[3]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), LORA_FLAGS,
                         ids=[FLAG_IDS[FLAGS.index(flags)] for flags in LORA_FLAGS])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], (300, 4, 8, 256, 128, 32)], ids=shape_id)
def test_rank_products_on_the_narrow_tile(shape, grouped_in, grouped_out, with_gates, with_lora, dtype, monkeypatch):
    """PYKERNELS_MOE_RANK_TILE=narrow (moe/moe.h): u, v, dB and dA on the 128 x 32 tile (r 5 padded to
    8, 16 over 512 mostly empty experts, 32 filling it), on Hopper beside the sm_90a core (bf16) and
    alone (fp16): against fp64 and the CPU, and bit for bit the wide tile's results (each output is
    the same MMAs along K in the same order), but for dA, whose operands the narrow tile swaps."""
    monkeypatch.setenv("PYKERNELS_MOE_RANK_TILE", "narrow")
    case = make_case(shape, grouped_in, with_gates, with_lora, dtype, seed=5)
    check_against_oracles(case, grouped_in, grouped_out, dtype)
    dy = torch.randn(grad_rows(case, grouped_out), shape[4], generator=torch.Generator().manual_seed(6)).to(dtype)
    narrow = run_ops(case, grouped_in, grouped_out, dy, "cuda")
    monkeypatch.setenv("PYKERNELS_MOE_RANK_TILE", "wide")
    wide = run_ops(case, grouped_in, grouped_out, dy, "cuda")
    for name in OUTPUTS:
        if name != "grad_lora_a":
            assert torch.equal(narrow[name], wide[name]), name


@pytest.mark.skipif(not HOPPER, reason="the Hopper GEMM core runs on compute capability 9.0")
@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS, ids=FLAG_IDS)
def test_hopper_grad_x_gathering_dy_in_its_mainloop(grouped_in, grouped_out, with_gates, with_lora, monkeypatch):
    """PYKERNELS_SM90_MOE_GATHER=mainloop: grad_x's GEMM reads dy by token itself (cp.async in its
    producer warp, csrc/common/extended_k_array_mainloop_sm90.cuh) when no weight gradient is asked;
    every layout flag, the grads against fp64 like the default's, and the output the pass's exactly."""
    monkeypatch.setenv("PYKERNELS_SM90_MOE_GATHER", "mainloop")
    case = make_case((300, 4, 8, 256, 128, 5), grouped_in, with_gates, with_lora, torch.bfloat16, seed=7)
    dy = torch.randn(grad_rows(case, grouped_out), 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    no_weight_grad = (True, False, True, True)  # grad_x, grad_weight, grad_gates, the LoRA grads
    gathered = run_ops(case, grouped_in, grouped_out, dy, "cuda", no_weight_grad)
    monkeypatch.setenv("PYKERNELS_SM90_MOE_GATHER", "pass")
    passed = run_ops(case, grouped_in, grouped_out, dy, "cuda", no_weight_grad)
    for name in OUTPUTS:
        assert torch.equal(gathered[name], passed[name]), name


@pytest.mark.parametrize(("grouped_in", "grouped_out", "with_gates", "with_lora"), FLAGS, ids=FLAG_IDS)
def test_unaligned_and_non_contiguous_inputs(grouped_in, grouped_out, with_gates, with_lora):
    """x starting one element into its allocation (SIMT instead of tensor cores) and a strided x
    (made contiguous by the op) give the aligned results within the budget / exactly."""
    case = make_case((300, 4, 8, 256, 128, 5), grouped_in, with_gates, with_lora, torch.bfloat16, seed=3)
    dy = torch.randn(grad_rows(case, grouped_out), 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    aligned = run_ops(case, grouped_in, grouped_out, dy, "cuda")
    flat = torch.empty(case["x"].numel() + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:] = case["x"].flatten().cuda()
    shifted = run_ops(dict(case, x=flat[1:].view(case["x"].shape)), grouped_in, grouped_out, dy, "cuda")
    column_major = case["x"].cuda().t().contiguous().t()
    strided = run_ops(dict(case, x=column_major), grouped_in, grouped_out, dy, "cuda")
    for name in OUTPUTS:
        assert torch.equal(strided[name], aligned[name]), name
        if aligned[name].numel():
            scale = aligned[name].double().abs().max().item()
            err = (shifted[name].double() - aligned[name].double()).abs().max().item()
            assert err <= 4 * ULP[torch.bfloat16] * scale, f"{name}: {err:.3e}"


def test_gradient_flags_and_determinism():
    """Each compute_grad_* flag alone gives its gradient bit-identical to the full run (and the
    others empty); two runs are bit-identical (no atomics anywhere)."""
    case = make_case((300, 4, 8, 256, 128, 5), False, True, True, torch.bfloat16, seed=5)
    dy = torch.randn(300, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    full = run_ops(case, False, False, dy, "cuda")
    again = run_ops(case, False, False, dy, "cuda")
    for name in OUTPUTS:
        assert torch.equal(full[name], again[name]), name
    names = [("grad_x",), ("grad_weight",), ("grad_gates",), ("grad_lora_a", "grad_lora_b")]
    for i, wanted in enumerate(names):
        flags = tuple(j == i for j in range(4))
        alone = run_ops(case, False, False, dy, "cuda", flags)
        for name in OUTPUTS[1:]:
            if name in wanted:
                assert torch.equal(alone[name], full[name]), (flags, name)
            else:
                assert alone[name].shape == (0,), (flags, name)


def test_fp32_gates_with_bf16_inputs():
    case = make_case((40, 4, 512, 64, 96, 16), False, True, False, torch.bfloat16, seed=8)
    dy = torch.randn(40, 96, generator=torch.Generator().manual_seed(9)).bfloat16()
    half_gates = run_ops(case, False, False, dy, "cuda")
    fp32_gates = run_ops(dict(case, gates=case["gates"].float()), False, False, dy, "cuda")
    assert fp32_gates["grad_gates"].dtype == torch.float32
    torch.testing.assert_close(fp32_gates["y"], half_gates["y"])
    torch.testing.assert_close(fp32_gates["grad_gates"], half_gates["grad_gates"].float(), atol=1e-2, rtol=1e-2)


def test_no_tokens():
    """T = 0: empty outputs, zero weight and LoRA gradients, like the CPU ops."""
    case = make_case((0, 2, 3, 16, 24, 4), False, True, True, torch.bfloat16)
    dy = torch.zeros(0, 24, dtype=torch.bfloat16)
    cuda, cpu = run_ops(case, False, False, dy, "cuda"), run_ops(case, False, False, dy, "cpu")
    for name in OUTPUTS:
        assert (cuda[name].dtype, cuda[name].shape) == (cpu[name].dtype, cpu[name].shape), name
        assert torch.equal(cuda[name].cpu(), cpu[name]), name


def test_no_host_synchronization():
    case = make_case((300, 4, 8, 256, 128, 5), False, True, True, torch.bfloat16, seed=10)
    dy = torch.randn(300, 128, generator=torch.Generator().manual_seed(11)).bfloat16().cuda()
    inputs = {name: v.cuda() if isinstance(v, torch.Tensor) else v for name, v in case.items()}
    with no_host_sync():
        run_ops(inputs, False, False, dy, "cuda")


def test_experts_forward_queues_without_a_host_synchronization():
    """The whole expert MLP (routing sort, both grouped GEMMs with LoRA, the gated activation, the gated
    per-token sum) forward and backward, as the model integrations call it: nothing waits for the GPU."""
    g = torch.Generator().manual_seed(12)
    tokens, hidden, inter, experts, top_k, rank = 64, 128, 64, 8, 2, 4
    idx = torch.randint(0, experts, (tokens, top_k), generator=g).cuda()
    leaves = [(torch.randn(*shape, generator=g) * 0.1).bfloat16().cuda().requires_grad_() for shape in
              [(tokens, hidden), (tokens, top_k), (experts, 2 * inter, hidden), (experts, hidden, inter),
               (rank * experts, hidden), (2 * inter, rank * experts)]]
    x, w, gate_up, down, a, b = leaves
    with no_host_sync():
        out = moe.experts_forward(x, idx, w, gate_up, down, lora={"gate_up_proj": moe.LoRAFactors(a, b, 0.5)})
        grads = torch.autograd.grad(out.float().square().sum(), leaves)
    assert all(grad is not None and grad.shape == leaf.shape for grad, leaf in zip(grads, leaves))


def test_bad_inputs_name_the_argument():
    case = {name: v.cuda() if isinstance(v, torch.Tensor) else v
            for name, v in make_case((6, 2, 3, 8, 5, 2), False, True, True, torch.float32).items()}
    routing = ops.moe_sort_tokens(case["idx"], 3)
    x, w = case["x"], case["weight"]
    with pytest.raises(ValueError, match="top_k_index must be 2-D"):
        ops.moe_sort_tokens(case["idx"].view(-1), 3)
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        ops.moe_grouped_linear(x, w.double(), *routing, 2, False, False)
    with pytest.raises(ValueError, match="lora_b must have shape \\(5, 6\\)"):
        ops.moe_grouped_linear(x, w, *routing, 2, False, False, None, case["lora_a"], case["lora_b"].t())
    with pytest.raises(ValueError, match="all tensors must be on x's device"):
        ops.moe_grouped_linear(x, w.cpu(), *routing, 2, False, False)
    with pytest.raises(ValueError, match="grad_y must have shape \\(12, 5\\)"):
        ops.moe_grouped_linear_backward(torch.zeros(6, 5, device="cuda"), x, w, *routing, 2, False, True, None, None,
                                        None, 1.0, True, True, True, True)


def test_opcheck():
    case = {name: v.cuda() if isinstance(v, torch.Tensor) else v
            for name, v in make_case((6, 2, 3, 16, 24, 2), False, True, True, torch.bfloat16).items()}
    torch.library.opcheck(ops.moe_sort_tokens, (case["idx"], 3))
    routing = ops.moe_sort_tokens(case["idx"], 3)
    x, w, gates = (case[name].requires_grad_() for name in ("x", "weight", "gates"))
    a, b = case["lora_a"].requires_grad_(), case["lora_b"].requires_grad_()
    torch.library.opcheck(ops.moe_grouped_linear, (x, w, *routing, 2, False, False, gates, a, b, SCALING))
    torch.library.opcheck(ops.moe_grouped_linear, (torch.randn(12, 16, device="cuda").bfloat16(), w.detach(),
                                                   *routing, 2, True, True))
    dy = torch.randn(6, 24, device="cuda").bfloat16()
    torch.library.opcheck(ops.moe_grouped_linear_backward,
                          (dy, x.detach(), w.detach(), *routing, 2, False, False, gates.detach(), a.detach(),
                           b.detach(), SCALING, True, True, True, True))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    case = {name: v.cuda() if isinstance(v, torch.Tensor) else v
            for name, v in make_case((10, 2, 4, 16, 24, 4), False, True, True, torch.bfloat16, seed=12).items()}
    routing = ops.moe_sort_tokens(case["idx"], 4)
    down_proj = torch.randn(4, 16, 24, device="cuda").bfloat16()
    leaves = [v.requires_grad_() for v in (case["x"], case["weight"], down_proj, case["gates"], case["lora_a"],
                                           case["lora_b"])]

    def step(x, up_proj, down_proj, gates, a, b):
        up = ops.moe_grouped_linear(x, up_proj, *routing, 2, False, True, None, a, b, SCALING)
        down = ops.moe_grouped_linear(up, down_proj, *routing, 2, True, False, gates)
        return down.float().square().sum()

    compiled = torch.compile(step, fullgraph=True)(*leaves)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    eager = step(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)
