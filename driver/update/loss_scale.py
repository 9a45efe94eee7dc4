"""Dynamic loss scaling for float16 training (model.dtype: float16): TRL's fp16=True, where accelerate runs torch's
GradScaler, with GradScaler's schedule.

float16 keeps 10 mantissa bits (bfloat16 7) but its exponent ends at 6e-5 (normal) and 6e-8 (subnormal): a
backward in float16 loses the small gradients bfloat16 keeps. The loss is multiplied by a scale before backward
(2^16 to start) and the update's gradients divided by it after; an update whose gradients overflowed (inf or NaN
on any rank) is skipped, as GradScaler skips it, with the schedule (transformers' Trainer steps its scheduler only
after an optimizer step that ran), and the scale halves; every 2000 updates in a row without overflow double it.
A scale halved below 1 stops the run with a message (DeepSpeed's min_loss_scale). float16's training-inference
mismatch is the smaller one (Qi et al. 2025, arXiv 2510.26788: the same 10 bits in vLLM and in training), which
is why an RL run may prefer it to bfloat16.

The scale and its count of good updates live in the optimizer's first parameter group, as algo.use_adaptive_entropy's
state does (driver/update/entropy_control.py): every checkpoint carries them and a resume continues the schedule.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from driver.config import Config
from driver.distributed import world as distributed

SCALE = "loss_scale"  # keys of the optimizer's first parameter group
GOOD_UPDATES = "loss_scale_good_updates"
INITIAL_SCALE, GROWTH, BACKOFF, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000  # torch.amp.GradScaler's defaults
# DeepSpeed's min_loss_scale: below it no scale helps (the gradients are inf or NaN however small the loss), and
# GradScaler would go on skipping every update while the run looked alive.
MIN_SCALE = 1.0


class LossScaleError(RuntimeError):
    """float16 training cannot go on: every scale overflowed (reported without a traceback)."""


def scales_loss(config: Config) -> bool:
    return config.model.dtype == "float16"


def _state(optimizer: torch.optim.Optimizer) -> dict:
    """The parameter group holding the scale; at its start the first time, and after a resume from a checkpoint
    written without it."""
    group = optimizer.param_groups[0]
    group.setdefault(SCALE, INITIAL_SCALE)
    group.setdefault(GOOD_UPDATES, 0)
    return group


def start_loss_scale(config: Config, optimizer: torch.optim.Optimizer) -> None:
    """The state's keys in place before a resume: torchrun's sharded load (driver/distributed/fsdp.py) fills only
    the keys the optimizer already has."""
    if scales_loss(config):
        _state(optimizer)


def loss_scale(config: Config, optimizer: torch.optim.Optimizer | None) -> float:
    """What the next update's losses are multiplied by before backward: 1 unless float16 trains."""
    if not scales_loss(config) or optimizer is None:
        return 1.0
    return _state(optimizer)[SCALE]


@torch.no_grad()
def unscale_gradients(config: Config, optimizer: torch.optim.Optimizer, holders: list[torch.Tensor]) -> bool:
    """Divides the update's gradients by the scale they were made with and moves the scale on; whether the update
    may step (every rank's gradients finite). Without float16 nothing is checked: True."""
    if not scales_loss(config):
        return True
    state = _state(optimizer)
    # A sharded gradient (FSDP) is checked and divided shard by shard: the scale multiplied all of it.
    grads = [h.grad.to_local() if isinstance(h.grad, DTensor) else h.grad for h in holders if h.grad is not None]
    finite = bool(torch.stack([torch.isfinite(grad).all() for grad in grads]).all()) if grads else True  # one sync
    overflowed = bool(distributed.max_int(int(not finite)))
    if overflowed:
        state[SCALE] *= BACKOFF
        state[GOOD_UPDATES] = 0
        if state[SCALE] < MIN_SCALE:
            raise LossScaleError(
                f"float16 training stopped: the gradients overflowed at every loss scale down to {MIN_SCALE:g} "
                f"(from {INITIAL_SCALE:g}), so they are inf or NaN however small the loss: a non-finite loss or "
                "weights (see loss and grad_norm in metrics.jsonl). The last checkpoint holds the weights from "
                "before; model.dtype: bfloat16 has float32's range")
        return False
    if grads:
        torch._foreach_mul_(grads, 1.0 / state[SCALE])
    state[GOOD_UPDATES] += 1
    if state[GOOD_UPDATES] == GROWTH_INTERVAL:
        state[SCALE] *= GROWTH
        state[GOOD_UPDATES] = 0
    return True
