"""Per-token logprobs and entropy with the lm_head fused in: public function, autograd and fakes.

The compiled ops (csrc/torch_bindings.cpp) never hold the [N, V] logits: they return logprobs,
entropy and the per-token log-sum-exp, which the backward op uses to recompute each logits tile.
"""

from __future__ import annotations

import torch

from pykernels import backend
from pykernels._dtensor import full
from pykernels._extension import check_device, ops
from pykernels.packed_sequences import IGNORE_INDEX
from pykernels.reference import logprobs as reference

_EMPTY_SHAPE = (0,)


# ---------------------------------------------------------------- fake implementations
@torch.library.register_fake("pykernels::token_logprobs")
def _token_logprobs_fake(hidden, weight, targets, temperature=1.0, ignore_index=IGNORE_INDEX, hidden_grad_terms=0):
    torch._check(weight.shape[1] == hidden.shape[1], lambda: "weight must have shape (vocab_size, hidden_size)")
    n = hidden.shape[0]
    per_token = tuple(hidden.new_empty((n,), dtype=torch.float32) for _ in range(3))
    shape = (hidden_grad_terms, n, hidden.shape[1]) if hidden_grad_terms and hidden.device.type == "cpu" else (0,)
    return (*per_token, hidden.new_empty(shape, dtype=torch.float32))


@torch.library.register_fake("pykernels::token_logprobs_backward")
def _token_logprobs_backward_fake(grad_logprobs, grad_entropy, hidden, weight, targets, lse, entropy,
                                  temperature=1.0, ignore_index=IGNORE_INDEX, compute_grad_hidden=True,
                                  compute_grad_weight=True):
    grad_hidden = hidden.new_empty(hidden.shape if compute_grad_hidden else _EMPTY_SHAPE)
    grad_weight = weight.new_empty(weight.shape if compute_grad_weight else _EMPTY_SHAPE)
    return grad_hidden, grad_weight


# ---------------------------------------------------------------- autograd
def _setup(ctx, inputs, output):
    hidden, weight, targets, temperature, ignore_index, _ = inputs
    _, entropy, lse, grad_terms = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy, grad_terms)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.mark_non_differentiable(lse, grad_terms)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a tensor of zeros


def _backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_grad_terms):  # lse, terms: no grad
    hidden, weight, targets, lse, entropy, grad_terms = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if need_hidden and not need_weight and grad_terms.dim() == 3:
        # The forward already computed d logprob / d hidden (and d entropy / d hidden): no logits
        # are recomputed. An entropy gradient without its term (not asked for) takes the op below.
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32)
        if grad_logprobs is not None:
            grad_hidden = grad_hidden + grad_logprobs.unsqueeze(1) * grad_terms[0]
        if grad_entropy is not None and grad_terms.shape[0] == 2:
            grad_hidden = grad_hidden + grad_entropy.unsqueeze(1) * grad_terms[1]
        elif grad_entropy is not None:
            grad_hidden = grad_hidden + ops.token_logprobs_backward(
                torch.zeros_like(lse), grad_entropy.contiguous(), hidden, weight, targets, lse, entropy,
                ctx.temperature, ctx.ignore_index, True, False)[0]
        return grad_hidden.to(hidden.dtype), None, None, None, None, None
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    grad_hidden, grad_weight = ops.token_logprobs_backward(
        grad_logprobs.contiguous(), None if grad_entropy is None else grad_entropy.contiguous(), hidden, weight,
        targets, lse, entropy, ctx.temperature, ctx.ignore_index, need_hidden, need_weight)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None, None, None, None, None)


torch.library.register_autograd("pykernels::token_logprobs", _backward, setup_context=_setup)


# ---------------------------------------------------------------- public function
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   ignore_index: int = IGNORE_INDEX, return_entropy: bool = False, entropy_grad: bool = True):
    """fp32 logprobs [N] of targets under softmax(hidden @ weight.T / temperature), and the entropy
    [N] of that distribution when return_entropy; both 0 (with zero gradient) where targets ==
    ignore_index. Gradients flow to hidden and weight from both outputs.

    Args:
        hidden: [N, H] final hidden states, fp32/fp16/bf16.
        weight: [V, H] lm_head weight in hidden's dtype (frozen or trainable; its gradient is
            summed in fp32 and rounded once).
        targets: [N] token ids in [0, V) or ignore_index.
        entropy_grad: False returns the entropy detached (e.g. only logged), which lets a forward
            with a frozen weight skip the work of its gradient.

    With a frozen weight and hidden needing a gradient (LoRA, QLoRA), the CPU forward also computes
    d logprob / d hidden (and d entropy / d hidden when the entropy is differentiable) and saves it,
    fp32 [N, H] each, so the backward does not recompute the logits.

    Example:
        >>> lp, ent = pykernels.logprobs.token_logprobs(h, model.lm_head.weight, targets, 0.7, return_entropy=True)
    """
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a tensor of token ids, got {type(targets).__name__}")
    hidden, weight, targets = full(hidden), full(weight), full(targets)  # FSDP2 / TP: gathered, explicitly
    if backend.use_reference("logprobs"):
        result = reference.token_logprobs(hidden, weight, targets, temperature, ignore_index, return_entropy)
        return (result[0], result[1] if entropy_grad else result[1].detach()) if return_entropy else result
    check_device(hidden, "hidden")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    targets = targets.long()
    terms = 0
    if torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad:
        terms = 2 if return_entropy and entropy_grad else 1
    logprobs, entropy, _, _ = ops.token_logprobs(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                                 float(temperature), int(ignore_index), terms)
    if not return_entropy:
        return logprobs
    return logprobs, (entropy if entropy_grad else entropy.detach())
