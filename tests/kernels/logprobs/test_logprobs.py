"""pykernels.logprobs.token_logprobs (CPU) against an fp64 oracle, torch's own low-precision path,
the pure-torch reference, opcheck, torch.compile and bad inputs."""

import pytest
import torch

from pykernels import backend
from pykernels.logprobs import IGNORE_INDEX, token_logprobs
from pykernels.reference import logprobs as reference
from tests.conftest import cpu_isas, forced_cpu_isa, oracle_once

ops = torch.ops.pykernels


def make(n, h, v, dtype, seed=0, ignore_every=5):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator).to(dtype)
    # lm_head-like scale: logits of a few units, a peaked but not one-hot distribution
    weight = (torch.randn(v, h, generator=generator) * 2.0 / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=generator)
    if ignore_every:
        targets[::ignore_every] = IGNORE_INDEX
    return hidden, weight, targets


def fp64_oracle(hidden, weight, targets, temperature, ignore_index=IGNORE_INDEX):
    """logprobs, entropy and the gradients of sum(g_lp * lp + g_ent * ent) in fp64."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    log_probs = torch.log_softmax(h @ w.T / temperature, -1)
    valid = targets != ignore_index
    lp = torch.where(valid, log_probs.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(log_probs.exp() * log_probs).sum(-1), 0.0)
    return lp, ent, h, w


def torch_lowprec(hidden, weight, targets, temperature, grad_lp, grad_ent, ignore_index=IGNORE_INDEX):
    """What users run today: materialized logits in the input dtype, fp32 log_softmax."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    log_probs = torch.log_softmax((h @ w.T).float() / temperature, -1)
    valid = targets != ignore_index
    lp = torch.where(valid, log_probs.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(log_probs.exp() * log_probs).sum(-1), 0.0)
    (lp * grad_lp + ent * grad_ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def max_err(x, oracle):
    return (x.double() - oracle).abs().max().item()


CASES = [  # (n, h, v): N = 1, 7, 4099; vocabularies that are not multiples of any chunk
    (1, 64, 50257),
    (7, 96, 50257),
    (4099, 64, 1517),
    (300, 33, 151936 // 8),
]


def oracles(n, h, v, dtype, temperature):
    """A case's inputs and gradient weights, and its fp64 oracle's and torch's low-precision results: the same for
    every ISA and weight mode, and most of each test's time (the [n, v] fp64 logits and their gradients)."""
    hidden, weight, targets = make(n, h, v, dtype, seed=n + v)
    generator = torch.Generator().manual_seed(1)
    grad_lp, grad_ent = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    lp64, ent64, h64, w64 = fp64_oracle(hidden, weight, targets, temperature)
    (lp64 * grad_lp.double() + ent64 * grad_ent.double()).sum().backward()
    oracle = (lp64.detach(), ent64.detach(), h64.grad, w64.grad)
    return (hidden, weight, targets, grad_lp, grad_ent), oracle, torch_lowprec(hidden, weight, targets, temperature,
                                                                                grad_lp, grad_ent)


@pytest.mark.parametrize("isa", cpu_isas(gemm=True))
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable_weight", "frozen_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("n,h,v", CASES)
def test_against_fp64(n, h, v, dtype, temperature, frozen, isa):
    """frozen_weight takes the forward that also computes d(logprob, entropy)/d hidden. Every CPU SIMD path with
    its bf16 GEMM (tests/conftest.py's gemm_cpu_isa, here innermost so that a case's oracles are computed once)."""
    (hidden, weight, targets, grad_lp, grad_ent), (lp64, ent64, h64_grad, w64_grad), (t_lp, t_ent, t_gh, t_gw) = \
        oracle_once(("logprobs", n, h, v, dtype, temperature), lambda: oracles(n, h, v, dtype, temperature))

    hid, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
    with forced_cpu_isa(isa):
        lp, ent = token_logprobs(hid, wt, targets, temperature, return_entropy=True)
        (lp * grad_lp + ent * grad_ent).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32 and hid.grad.dtype == dtype

    tol = 2e-5  # fp32 summation noise over V terms
    assert max_err(lp, lp64) <= max_err(t_lp, lp64) + tol
    assert max_err(ent, ent64) <= max_err(t_ent, ent64) + tol
    # Gradients: no worse than torch's own path in this dtype, plus one rounding of the result.
    grads = [(hid.grad, t_gh, h64_grad)] + ([] if frozen else [(wt.grad, t_gw, w64_grad)])
    for ours, theirs, oracle in grads:
        scale = oracle.abs().max().item()
        rounding = scale * (2**-8 if dtype == torch.bfloat16 else 1e-5)
        assert max_err(ours, oracle) <= max_err(theirs, oracle) + rounding
    valid = targets != IGNORE_INDEX
    assert not lp[~valid].any() and not ent[~valid].any()
    assert not hid.grad[~valid].any(), "ignored rows must get exactly zero gradient"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(dtype):
    hidden, weight, targets = make(37, 40, 1000, dtype)
    args = (targets, 0.9, IGNORE_INDEX, True)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs(h1, w1, *args)
    (lp.sum() - 0.5 * ent.sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with backend.kernels_mode("reference"):
        lp_ref, ent_ref = token_logprobs(h2, w2, *args)
    (lp_ref.sum() - 0.5 * ent_ref.sum()).backward()
    torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=1e-4)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), atol=atol, rtol=1e-2)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), atol=atol, rtol=1e-2)


def test_entropy_gradient_alone_and_frozen_weight():
    hidden, weight, targets = make(19, 24, 300, torch.float32)
    h = hidden.clone().requires_grad_()
    _, ent = token_logprobs(h, weight, targets, 1.0, return_entropy=True)
    ent.sum().backward()
    _, ent64, h64, _ = fp64_oracle(hidden, weight, targets, 1.0)
    ent64.sum().backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    assert weight.grad is None


@pytest.mark.parametrize("return_entropy,entropy_grad,use_entropy", [
    (False, True, False), (True, True, True), (True, False, False), (True, True, False)])
def test_frozen_weight_paths_match_the_recomputing_backward(return_entropy, entropy_grad, use_entropy):
    """The forward-computed hidden gradient (every combination of terms) equals the op that
    recomputes the logits in the backward, which a trainable weight forces."""
    hidden, weight, targets = make(70, 48, 1000, torch.float32)
    grad_lp = torch.randn(70)

    def hidden_grad(trainable):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        out = token_logprobs(h, w, targets, 0.8, return_entropy=return_entropy, entropy_grad=entropy_grad)
        lp, ent = out if return_entropy else (out, None)
        loss = (lp * grad_lp).sum() + (0.3 * ent.sum() if use_entropy else 0)
        loss.backward()
        return h.grad

    torch.testing.assert_close(hidden_grad(False), hidden_grad(True), atol=2e-5, rtol=1e-4)


def test_detached_entropy():
    hidden, weight, targets = make(5, 16, 50, torch.float32)
    _, ent = token_logprobs(hidden.requires_grad_(), weight, targets, return_entropy=True, entropy_grad=False)
    assert not ent.requires_grad


def test_all_ignored_and_custom_ignore_index():
    hidden, weight, _ = make(5, 16, 50, torch.float32)
    h = hidden.clone().requires_grad_()
    lp = token_logprobs(h, weight, torch.full((5,), IGNORE_INDEX), 1.0)
    lp.sum().backward()
    assert not lp.any() and not h.grad.any()
    # ignore_index may be a real token id: rows with it are ignored, the others are scored
    targets = torch.tensor([0, 3, 0, 7, 9])
    lp = token_logprobs(hidden, weight, targets, 1.0, ignore_index=0)
    expected, _, _, _ = fp64_oracle(hidden, weight, targets, 1.0, ignore_index=0)
    assert lp[0] == 0 and lp[2] == 0
    torch.testing.assert_close(lp.double(), expected.detach(), atol=1e-5, rtol=1e-5)


def test_empty_input():
    hidden = torch.zeros(0, 8, requires_grad=True)
    lp = token_logprobs(hidden, torch.randn(10, 8), torch.zeros(0, dtype=torch.long))
    lp.sum().backward()
    assert lp.shape == (0,) and hidden.grad.shape == (0, 8)


def test_opcheck():
    hidden, weight, targets = make(11, 20, 70, torch.float32)
    torch.library.opcheck(ops.token_logprobs, (hidden, weight.requires_grad_(), targets, 0.8, IGNORE_INDEX))
    for terms in (1, 2):
        torch.library.opcheck(ops.token_logprobs,
                              (hidden.clone().requires_grad_(), weight.detach(), targets, 0.8, IGNORE_INDEX, terms))
    lp, ent, lse, _ = ops.token_logprobs(hidden, weight.detach(), targets, 0.8, IGNORE_INDEX)
    grad = torch.randn(11)
    torch.library.opcheck(ops.token_logprobs_backward,
                          (grad, grad.clone(), hidden, weight.detach(), targets, lse, ent, 0.8, IGNORE_INDEX,
                           True, True))
    torch.library.opcheck(ops.token_logprobs_backward,
                          (grad, None, hidden, weight.detach(), targets, lse, ent, 0.8, IGNORE_INDEX, True, False))


def test_torch_compile_fullgraph():
    hidden, weight, targets = make(29, 32, 200, torch.float32)

    def loss(h, w):
        lp, ent = token_logprobs(h, w, targets, 0.7, return_entropy=True)
        return (lp - 0.01 * ent).sum()

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.compile(loss, fullgraph=True, dynamic=True)(h1, w1).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss(h2, w2).backward()
    torch.testing.assert_close(h1.grad, h2.grad)
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_bad_inputs(kernels):
    h, w = torch.randn(3, 8), torch.randn(10, 8)
    with backend.kernels_mode(kernels):
        with pytest.raises(ValueError, match=r"weight must have shape \(vocab_size, 8\)|must share H"):
            token_logprobs(h, torch.randn(10, 9), torch.zeros(3, dtype=torch.long))
        with pytest.raises(ValueError, match=r"targets\[1\] = 10 is outside the vocabulary \[0, 10\)|"
                                             r"targets must be in \[0, 10\)"):
            token_logprobs(h, w, torch.tensor([0, 10, 2]))
        with pytest.raises(ValueError, match=r"targets\[0\] = -1|targets must be in"):
            token_logprobs(h, w, torch.tensor([-1, 0, 2]))
        with pytest.raises(ValueError, match=r"targets must have shape \(3,\)"):
            token_logprobs(h, w, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight must have hidden's dtype"):
        token_logprobs(h, w.bfloat16(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        token_logprobs(h, w, torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        token_logprobs(h[None], w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be integer token ids"):
        token_logprobs(h, w, torch.zeros(3))
    with pytest.raises(ValueError, match="hidden must be float32, float16 or bfloat16"):
        token_logprobs(h.double(), w.double(), torch.zeros(3, dtype=torch.long))


def test_reference_is_chunked_and_matches_fp64():
    """The pure-torch reference (fallback and benchmark baseline) against fp64, across chunks."""
    hidden, weight, targets = make(reference.CHUNK_TOKENS + 3, 16, 301, torch.float32)
    lp, ent = reference.token_logprobs(hidden, weight, targets, 1.3, return_entropy=True)
    lp64, ent64, _, _ = fp64_oracle(hidden, weight, targets, 1.3)
    torch.testing.assert_close(lp.double(), lp64.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), atol=1e-5, rtol=1e-5)
