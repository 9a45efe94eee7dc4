"""Per-token logprobs and entropy with the lm_head fused in: public function, autograd and fakes.

The compiled ops (csrc/torch_bindings.cpp) never hold the [N, V] logits: they return logprobs,
entropy and the per-token log-sum-exp, which the backward op uses to recompute each logits tile.
"""

from __future__ import annotations

import torch

from pykernels import backend
from pykernels._extension import check_device, ops
from pykernels.reference import logprobs as reference

IGNORE_INDEX = reference.IGNORE_INDEX
_EMPTY_SHAPE = (0,)


# ---------------------------------------------------------------- fake implementations
@torch.library.register_fake("pykernels::token_logprobs")
def _token_logprobs_fake(hidden, weight, targets, temperature=1.0, ignore_index=IGNORE_INDEX):
    torch._check(weight.shape[1] == hidden.shape[1], lambda: "weight must have shape (vocab_size, hidden_size)")
    n = hidden.shape[0]
    return tuple(hidden.new_empty((n,), dtype=torch.float32) for _ in range(3))


@torch.library.register_fake("pykernels::token_logprobs_backward")
def _token_logprobs_backward_fake(grad_logprobs, grad_entropy, hidden, weight, targets, lse, entropy,
                                  temperature=1.0, ignore_index=IGNORE_INDEX, compute_grad_hidden=True,
                                  compute_grad_weight=True):
    grad_hidden = hidden.new_empty(hidden.shape if compute_grad_hidden else _EMPTY_SHAPE)
    grad_weight = weight.new_empty(weight.shape if compute_grad_weight else _EMPTY_SHAPE)
    return grad_hidden, grad_weight


# ---------------------------------------------------------------- autograd
def _setup(ctx, inputs, output):
    hidden, weight, targets, temperature, ignore_index = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logprobs, grad_entropy, grad_lse):
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    grad_hidden, grad_weight = ops.token_logprobs_backward(
        grad_logprobs.contiguous(), None if grad_entropy is None else grad_entropy.contiguous(), hidden, weight,
        targets, lse, entropy, ctx.temperature, ctx.ignore_index, need_hidden, need_weight)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None, None, None, None)


torch.library.register_autograd("pykernels::token_logprobs", _backward, setup_context=_setup)


# ---------------------------------------------------------------- public function
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   ignore_index: int = IGNORE_INDEX, return_entropy: bool = False):
    """fp32 logprobs [N] of targets under softmax(hidden @ weight.T / temperature), and the entropy
    [N] of that distribution when return_entropy; both 0 (with zero gradient) where targets ==
    ignore_index. Gradients flow to hidden and weight from both outputs.

    Args:
        hidden: [N, H] final hidden states, fp32/fp16/bf16.
        weight: [V, H] lm_head weight in hidden's dtype (frozen or trainable; its gradient is
            summed in fp32 and rounded once).
        targets: [N] token ids in [0, V) or ignore_index.

    Example:
        >>> lp, ent = pykernels.logprobs.token_logprobs(h, model.lm_head.weight, targets, 0.7, return_entropy=True)
    """
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"targets must be a tensor of token ids, got {type(targets).__name__}")
    if backend.use_reference():
        return reference.token_logprobs(hidden, weight, targets, temperature, ignore_index, return_entropy)
    check_device(hidden, "hidden")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    targets = targets.long()
    logprobs, entropy, _ = ops.token_logprobs(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                              float(temperature), int(ignore_index))
    return (logprobs, entropy) if return_entropy else logprobs
