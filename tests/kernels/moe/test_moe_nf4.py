"""experts_forward on NF4 expert weights (QLoRA on MoE): equal to the same kernels on the dequantized
weights, close to an fp64 reference, which experts are dequantized (all, or the routed ones when T * k < E),
no dense weight kept for the backward, no host synchronization, and clear errors."""

import pytest
import torch

import pykernels.nf4 as nf4
from conftest import requires_cuda
from cuda_sync import no_host_sync
from pykernels import backend, moe
from pykernels.nf4_weight import NF4Weight
from pykernels.ops import moe_nf4
from pykernels.reference import moe as reference

# (tokens, hidden, inter, experts, top_k, unrouted experts, blocksize). 2I*H = 2*16*24 = 768 is not a
# multiple of 512: that case dequantizes every expert (no block boundary between experts). T * k < E
# (fewer assignments than experts: only routed experts, padded) in the third and the last.
CASES = [(37, 64, 32, 8, 2, 3, 64), (9, 24, 16, 5, 3, 1, 128), (5, 24, 16, 6, 1, 4, 512), (16, 32, 16, 1, 1, 0, 64),
         (3, 64, 32, 16, 2, 5, 64)]


def make_problem(tokens, hidden, inter, experts, top_k, unrouted, blocksize, dtype, double_quant, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, experts - unrouted, (tokens, top_k), generator=g)
    gate_up = nf4.quantize((torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(dtype), blocksize,
                           double_quant=double_quant)
    down = nf4.quantize((torch.randn(experts, hidden, inter, generator=g) / 8).to(dtype), blocksize,
                        double_quant=double_quant)
    r = 4
    leaves = [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in
              [(tokens, hidden), (tokens, top_k), (r * experts, hidden), (2 * inter, r * experts),
               (r * experts, inter), (hidden, r * experts)]]
    return idx, gate_up, down, leaves


def run(fn, idx, gate_up, down, leaves):
    x, w, a1, b1, a2, b2 = leaves
    lora = {"gate_up_proj": moe.LoRAFactors(a1, b1, 0.5), "down_proj": moe.LoRAFactors(a2, b2, 2.0)}
    out = fn(x, idx, w, gate_up, down, lora=lora)
    return [out, *torch.autograd.grad(out.square().sum(), leaves)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_experts_equal_the_kernels_on_dequantized_weights(case, dtype, double_quant):
    idx, gate_up, down, leaves = make_problem(*case, dtype, double_quant)
    ours = run(moe.experts_forward, idx, gate_up, down, leaves)
    dense = run(moe.experts_forward, idx, gate_up.dequantize(dtype), down.dequantize(dtype), leaves)
    for name, a, b in zip(["out", "x", "gates", "A1", "B1", "A2", "B2"], ours, dense):
        assert torch.equal(a, b), name  # compaction only drops experts the GEMM never reads
    if dtype == torch.float32:
        exact = run(reference.experts_forward, idx, gate_up.dequantize().double(),
                    down.dequantize().double(), [t.detach().double().requires_grad_() for t in leaves])
        for name, a, b in zip(["out", "x", "gates", "A1", "B1", "A2", "B2"], ours, exact):
            assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max(), name


@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_experts_is_the_full_dequantize_of_those_experts(double_quant):
    weight = nf4.quantize(torch.randn(7, 48, 32, dtype=torch.bfloat16), 64, double_quant=double_quant)
    for experts in ([0], [1, 4, 6], [6], list(range(7))):
        ids = torch.tensor(experts)
        assert torch.equal(moe_nf4.dequantize_experts(weight, ids, torch.bfloat16),
                           weight.dequantize(torch.bfloat16)[ids]), experts


@pytest.mark.parametrize(("tokens", "dequantized_experts"), [(37, 8), (3, 6)])
def test_experts_dequantized_per_call_and_no_dense_weight_is_kept(monkeypatch, tokens, dequantized_experts):
    """All 8 experts when T * k >= E; with T * k = 6 < 8, a list of 6: the routed ones, padded."""
    hidden, inter, experts = 64, 32, 8
    idx, gate_up, down, leaves = make_problem(tokens, hidden, inter, experts, 2, 3, 64, torch.float32, True)
    dequantized = []
    original = NF4Weight.dequantize
    monkeypatch.setattr(NF4Weight, "dequantize", lambda self, dtype=None: dequantized.append(self.shape[0])
                        or original(self, dtype))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x, w, a1, b1, a2, b2 = leaves
        out = moe.experts_forward(x, idx, w, gate_up, down, lora={"gate_up_proj": moe.LoRAFactors(a1, b1, 0.5)})
    assert dequantized == [dequantized_experts] * 2  # gate_up and down
    assert max(saved) < dequantized_experts * inter * hidden  # no dequantized weight (down: the smaller) is kept
    out.sum().backward()
    assert dequantized == [dequantized_experts] * 4  # dequantized again for grad_x
    assert x.grad is not None and w.grad is not None and a1.grad is not None


@pytest.mark.parametrize(("tokens", "top_k", "experts", "seed"),
                         [(3, 2, 16, 0), (1, 3, 8, 1), (5, 1, 7, 2), (0, 2, 4, 3)])
def test_compact_routing_lists_the_routed_experts_as_a_host_oracle_does(tokens, top_k, experts, seed):
    """T * k < E: the routed experts in id order, then padding (expert 0, empty groups); slots renumbered
    to their expert's place, dropped ids (>= E: another rank's) to the last bucket. Checked against
    Python on the host, with ids outside [0, E) among them."""
    g = torch.Generator().manual_seed(seed)
    top_k_index = torch.randint(-1, experts + 2, (tokens, top_k), generator=g)
    routing = moe.sort_tokens(top_k_index, experts)
    compact = moe_nf4.compact_routing(*routing)
    ids = [e for e in top_k_index.flatten().tolist() if 0 <= e < experts]
    routed = sorted(set(ids))
    size = max(tokens * top_k, 1)
    assert compact.experts.tolist() == routed + [0] * (size - len(routed))
    counts = [ids.count(e) for e in routed] + [0] * (size - len(routed))
    assert compact.expert_offsets.diff().tolist() == counts
    assert compact.expert_offsets[-1] == routing[2][-1]  # the dropped bucket starts where it did
    place = {e: i for i, e in enumerate(routed)}
    assert compact.sorted_expert_idx.tolist() == [place.get(e, size) for e in routing[0].tolist()]
    assert torch.equal(compact.sorted_token_idx, routing[1])


def test_compact_routing_reads_nothing_on_the_host():
    """Shapes alone decide it: it runs on meta tensors, which hold no data (torch.nonzero cannot)."""
    top_k_index = torch.tensor([[3, 1], [1, 9]])
    routing = [t.to("meta") for t in moe.sort_tokens(top_k_index, 16)]
    compact = moe_nf4.compact_routing(*routing)
    assert compact.experts.shape == (4,) and compact.expert_offsets.shape == (5,)
    assert compact.sorted_expert_idx.shape == (4,)


def test_reference_backend_dequantizes_and_runs_the_reference():
    idx, gate_up, down, leaves = make_problem(*CASES[1], torch.float32, False)
    backend.set_kernels("reference")
    try:
        ours = run(moe.experts_forward, idx, gate_up, down, leaves)
    finally:
        backend.set_kernels("auto")
    ref = run(reference.experts_forward, idx, gate_up.dequantize(), down.dequantize(), leaves)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens", [0, 6])
def test_no_routed_expert_gives_zeros(tokens):
    idx, gate_up, down, leaves = make_problem(*CASES[1], torch.float32, False)
    x = torch.randn(tokens, 24, requires_grad=True)
    w = torch.rand(tokens, 3, requires_grad=True)
    dropped = torch.full((tokens, 3), 5)  # every id belongs to another rank (expert parallelism)
    lora = {"down_proj": moe.LoRAFactors(*leaves[4:], 1.0)}
    out = moe.experts_forward(x, dropped, w, gate_up, down, lora=lora)
    assert out.shape == (tokens, 24) and not out.any()
    out.sum().backward()
    assert not x.grad.any() and not w.grad.any()


def test_bad_nf4_inputs_are_clear_errors():
    idx, gate_up, down, leaves = make_problem(*CASES[1], torch.float32, False)
    x, w = leaves[:2]
    with pytest.raises(ValueError, match="both be NF4Weights or both be tensors"):
        moe.experts_forward(x, idx, w, gate_up, down.dequantize())
    flat = nf4.quantize(torch.randn(32, 24), 64)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[E, 2I, H\]"):
        moe.experts_forward(x, idx, w, flat, down)
    other = nf4.quantize(torch.randn(4, 24, 16), 64)
    with pytest.raises(ValueError, match="gate_up_proj has 5 experts and down_proj 4"):
        moe.experts_forward(x, idx, w, gate_up, other)
    bad_lora = moe.LoRAFactors(torch.randn(7, 24), torch.randn(32, 7), 1.0)
    with pytest.raises(ValueError, match=r"LoRA factors for 5 experts must be A \[r\*E, in\]"):
        moe.experts_forward(x, idx, w, gate_up, down, lora={"gate_up_proj": bad_lora})


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [37, 3])  # T * k >= E, and < E (the routed experts, padded)
def test_cuda_nf4_experts_run_without_a_host_synchronization(tokens):
    """QLoRA's MoE layer queues its whole forward and backward without waiting for the GPU (torch.nonzero
    in the compaction did, once per layer), and equals the kernels on the dequantized weights."""
    idx, gate_up, down, leaves = make_problem(tokens, 64, 32, 8, 2, 3, 64, torch.bfloat16, True)
    idx, gate_up, down = idx.cuda(), gate_up.to("cuda"), down.to("cuda")
    leaves = [t.detach().cuda().requires_grad_() for t in leaves]
    dense_gate_up, dense_down = gate_up.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16)
    with no_host_sync():
        ours = run(moe.experts_forward, idx, gate_up, down, leaves)
    dense = run(moe.experts_forward, idx, dense_gate_up, dense_down, leaves)  # ours too (tests/conftest.py)
    for name, a, b in zip(["out", "x", "gates", "A1", "B1", "A2", "B2"], ours, dense):
        assert torch.equal(a, b), name
