"""algo.use_adaptive_entropy: Skywork-OR1's entropy control (arXiv 2505.22312), as TRL's GRPOTrainer runs it.

The entropy bonus's coefficient for an optimizer update is decided before it: the controller's, applied only while
the previous update's mean token entropy was at or below entropy_target (none before the first measurement). After
the update's backward the update's entropy (over its loss tokens, the kept ones with top_entropy_quantile, every
rank's) moves the coefficient by entropy_coef_delta: up when at or below the target, down otherwise, within
[entropy_coef_min, entropy_coef_max].

The coefficient and the last entropy live in the optimizer's parameter group beside its learning rate, so every
checkpoint's optimizer state carries them and a resume continues the control where it was.
"""

from __future__ import annotations

import math

import torch

from driver.config import AlgoConfig

COEF = "adaptive_entropy_coef"  # keys of the optimizer's first parameter group
LAST_ENTROPY = "adaptive_entropy_last"


def controller(algo: AlgoConfig, optimizer: torch.optim.Optimizer) -> dict:
    """The parameter group holding the state; set to the start (algo.entropy_coef, no measurement) the first time,
    and after a resume from a checkpoint written without it."""
    group = optimizer.param_groups[0]
    group.setdefault(COEF, algo.entropy_coef)
    group.setdefault(LAST_ENTROPY, math.inf)
    return group


def applied_entropy_coef(algo: AlgoConfig, optimizer: torch.optim.Optimizer) -> float:
    """The entropy bonus's coefficient for the next optimizer update."""
    if not algo.use_adaptive_entropy:
        return algo.entropy_coef
    state = controller(algo, optimizer)
    return state[COEF] if state[LAST_ENTROPY] <= algo.entropy_target else 0.0


def observe_entropy(algo: AlgoConfig, optimizer: torch.optim.Optimizer, entropy: float) -> float:
    """An update's mean token entropy moves the coefficient; returns the new coefficient (TRL's entropy_coef metric)."""
    state = controller(algo, optimizer)
    if entropy <= algo.entropy_target:
        state[COEF] = min(state[COEF] + algo.entropy_coef_delta, algo.entropy_coef_max)
    else:
        state[COEF] = max(state[COEF] - algo.entropy_coef_delta, algo.entropy_coef_min)
    state[LAST_ENTROPY] = entropy
    return state[COEF]
