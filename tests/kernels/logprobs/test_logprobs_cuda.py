"""CUDA token_logprobs against the fp64 oracle, torch's own low-precision error, and the CPU op.

Same rule as tests/kernels/logprobs/test_logprobs.py: max|ours - fp64| <= max|torch_lowprec - fp64| + tol, for
logprobs, entropy and both gradients; CUDA and CPU agree within the sum of their budgets.
"""

import pytest
import torch
from test_logprobs import fp64_oracle, make, max_err, torch_lowprec

from conftest import requires_cuda
from pykernels import _C
from pykernels.logprobs import IGNORE_INDEX, token_logprobs

pytestmark = [requires_cuda, pytest.mark.cuda]

# (n, h, v): odd H and V take the SIMT GEMMs, multiples of 8 the tensor cores; 4099 tokens and
# V = 50257 / 151936 / 9000 span several token and vocabulary chunks (4096 x 8192).
CASES = [(1, 64, 50257), (7, 96, 50257), (4099, 64, 9000), (300, 33, 1517), (513, 128, 151936)]


def with_oracles(n, h, v, dtype, temperature, grad_seed):
    """A case's inputs and output gradients (on the CPU, and the same on CUDA), the fp64 oracle's
    logprobs and entropy with hidden and weight holding its gradients, and torch's own low-precision
    results on CUDA (logprobs, entropy, both gradients)."""
    hidden, weight, targets = make(n, h, v, dtype, seed=n + v)
    generator = torch.Generator().manual_seed(grad_seed)
    grad_lp, grad_ent = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    lp64, ent64, h64, w64 = fp64_oracle(hidden, weight, targets, temperature)
    (lp64 * grad_lp.double() + ent64 * grad_ent.double()).sum().backward()
    inputs = (hidden, weight, targets, grad_lp, grad_ent)
    cuda = [t.cuda() for t in inputs]
    lowprec = [t.cpu() for t in torch_lowprec(*cuda[:3], temperature, *cuda[3:])]
    return inputs, cuda, (lp64, ent64, h64, w64), lowprec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("n,h,v", CASES)
def test_against_fp64_and_cpu(n, h, v, dtype, temperature):
    (hidden, weight, targets, grad_lp, grad_ent), _, (lp64, ent64, h64, w64), lowprec = with_oracles(
        n, h, v, dtype, temperature, grad_seed=1)
    t_lp, t_ent, t_gh, t_gw = lowprec

    results = {}
    for device in ("cuda", "cpu"):
        hid = hidden.to(device).requires_grad_()
        wt = weight.to(device).requires_grad_()
        lp, ent = token_logprobs(hid, wt, targets.to(device), temperature, return_entropy=True)
        (lp * grad_lp.to(device) + ent * grad_ent.to(device)).sum().backward()
        results[device] = [t.detach().cpu() for t in (lp, ent, hid.grad, wt.grad)]
    tol = 2e-5
    lp, ent, gh, gw = results["cuda"]
    assert max_err(lp, lp64.detach()) <= max_err(t_lp, lp64.detach()) + tol
    assert max_err(ent, ent64.detach()) <= max_err(t_ent, ent64.detach()) + tol
    for ours, theirs, oracle in ((gh, t_gh, h64.grad), (gw, t_gw, w64.grad)):
        rounding = oracle.abs().max().item() * (2**-8 if dtype != torch.float32 else 1e-5)
        assert max_err(ours, oracle) <= max_err(theirs, oracle) + rounding
    for cuda_value, cpu_value in zip(results["cuda"], results["cpu"]):
        torch.testing.assert_close(cuda_value.float(), cpu_value.float(), atol=2e-2 if dtype != torch.float32 else 1e-4,
                                   rtol=2e-2)
    valid = targets != IGNORE_INDEX
    assert not gh[~valid].any()



# A frozen lm_head (LoRA) takes the backward that walks tokens outermost (kFrozenTokenChunk = 512 rows):
# 1100 and 4099 tokens end on a partial chunk, 513 on a chunk of one token, 300 fits in one.
FROZEN_CASES = [(1100, 128, 9000), (4099, 64, 9000), (513, 128, 151936), (300, 33, 1517)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("n,h,v", FROZEN_CASES)
def test_frozen_lm_head_against_fp64_and_the_trainable_backward(n, h, v, dtype, temperature):
    (_, _, targets, _, _), cuda, (_, _, h64, _), lowprec = with_oracles(n, h, v, dtype, temperature, grad_seed=2)
    t_gh = lowprec[2]

    def grad_hidden(train_weight: bool) -> torch.Tensor:
        hid, wt = cuda[0].clone().requires_grad_(), cuda[1].clone().requires_grad_(train_weight)
        lp, ent = token_logprobs(hid, wt, cuda[2], temperature, return_entropy=True)
        (lp * cuda[3] + ent * cuda[4]).sum().backward()
        assert wt.grad is None or train_weight
        return hid.grad.cpu()

    frozen, trainable = grad_hidden(False), grad_hidden(True)
    rounding = h64.grad.abs().max().item() * (2**-8 if dtype != torch.float32 else 1e-5)
    assert max_err(frozen, h64.grad) <= max_err(t_gh, h64.grad) + rounding
    # Both sum the same fp32 products per token over the vocabulary chunks in the same order (cuBLAS may
    # split them differently): one rounding of the result apart, an ulp of the largest magnitude at most.
    ulp = h64.grad.abs().max().item() * (2**-7 if dtype != torch.float32 else 1e-5)
    torch.testing.assert_close(frozen.float(), trainable.float(), atol=ulp, rtol=0)
    assert not frozen[targets == IGNORE_INDEX].any()

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="the Hopper lm_head GEMMs' tiles run on compute capability 9.0")
@pytest.mark.parametrize("tile", _C.host_logic.logprobs_sm90_tiles)  # logprobs/logprobs_sm90.h
@pytest.mark.parametrize("fold", ["running_max", "lazy_max"])  # PYKERNELS_SM90_LOGPROBS_FOLD, the same file
@pytest.mark.parametrize("n,h,v", [(4099, 64, 9000), (513, 128, 151936), (300, 64, 776)])
def test_every_hopper_tile_against_fp64(n, h, v, tile, fold, monkeypatch):
    """Each tile of the Hopper lm_head GEMMs (PYKERNELS_SM90_LOGPROBS_TILE, read on every call) with
    each fold of the statistics epilogue, bf16, forward and trainable backward: 4099 tokens over two
    token chunks and a partial 256-row tile, 513 over 151936 entries (three vocabulary chunks), 300
    tokens over 776 (a partial vocabulary tile)."""
    monkeypatch.setenv("PYKERNELS_SM90_LOGPROBS_TILE", tile)
    monkeypatch.setenv("PYKERNELS_SM90_LOGPROBS_FOLD", fold)
    (_, _, _, _, _), cuda, (lp64, ent64, h64, w64), (t_lp, t_ent, t_gh, t_gw) = with_oracles(
        n, h, v, torch.bfloat16, 0.7, grad_seed=3)
    hid, wt = cuda[0].clone().requires_grad_(), cuda[1].clone().requires_grad_()
    lp, ent = token_logprobs(hid, wt, cuda[2], 0.7, return_entropy=True)
    (lp * cuda[3] + ent * cuda[4]).sum().backward()
    tol = 2e-5
    assert max_err(lp.detach().cpu(), lp64.detach()) <= max_err(t_lp, lp64.detach()) + tol
    assert max_err(ent.detach().cpu(), ent64.detach()) <= max_err(t_ent, ent64.detach()) + tol
    for ours, theirs, oracle in ((hid.grad.cpu(), t_gh, h64.grad), (wt.grad.cpu(), t_gw, w64.grad)):
        assert max_err(ours, oracle) <= max_err(theirs, oracle) + oracle.abs().max().item() * 2**-8


def test_opcheck_cuda():
    hidden, weight, targets = (t.cuda() for t in make(11, 24, 70, torch.bfloat16))
    torch.library.opcheck(torch.ops.pykernels.token_logprobs, (hidden, weight, targets, 0.8, IGNORE_INDEX))


def test_bad_targets_cuda_checked_eagerly(monkeypatch):
    """PYKERNELS_CHECK_TARGETS=1: every call checks its targets first (a host sync) and names the bad one."""
    monkeypatch.setenv("PYKERNELS_CHECK_TARGETS", "1")
    hidden, weight = torch.randn(3, 8, device="cuda"), torch.randn(10, 8, device="cuda")
    with pytest.raises(ValueError, match=r"targets\[1\] = 10 is outside the vocabulary"):
        token_logprobs(hidden, weight, torch.tensor([0, 10, 2], device="cuda"))
    with pytest.raises(ValueError, match="targets must be on"):
        token_logprobs(hidden, weight, torch.tensor([0, 1, 2]))


def test_bad_targets_cuda_reported_by_the_next_call(monkeypatch):
    """Default: no host sync; the bad token's logprob is NaN and the next call raises, naming it."""
    monkeypatch.delenv("PYKERNELS_CHECK_TARGETS", raising=False)
    hidden, weight = torch.randn(3, 8, device="cuda"), torch.randn(10, 8, device="cuda")
    lp = token_logprobs(hidden, weight, torch.tensor([0, -5, 2], device="cuda"))
    torch.cuda.synchronize()
    assert lp[1].isnan() and lp[[0, 2]].isfinite().all()
    good = torch.tensor([0, 1, IGNORE_INDEX], device="cuda")
    with pytest.raises(ValueError, match=r"targets\[1\] of an earlier token_logprobs call"):
        token_logprobs(hidden, weight, good)
    assert token_logprobs(hidden, weight, good).isfinite().all()  # reported once, then cleared


def test_capture_in_a_cuda_graph(monkeypatch):
    """No host sync in the forward: it records into a CUDA graph and replays on new inputs."""
    monkeypatch.delenv("PYKERNELS_CHECK_TARGETS", raising=False)
    hidden, weight, targets = (t.cuda() for t in make(37, 64, 1517, torch.bfloat16, seed=3))
    expected = token_logprobs(hidden, weight, targets)  # warm-up: allocations and the target flag
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        token_logprobs(hidden, weight, targets)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = token_logprobs(hidden, weight, targets)
    graph.replay()
    torch.testing.assert_close(captured, expected, atol=0, rtol=0)
    hidden.copy_(torch.randn_like(hidden))
    graph.replay()
    torch.testing.assert_close(captured, token_logprobs(hidden, weight, targets), atol=0, rtol=0)
