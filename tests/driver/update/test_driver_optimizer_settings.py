"""TRL's adam_beta1 / adam_beta2 / adam_epsilon (train.*) reach every optimizer train.optim builds, and the
cosine schedule's min_lr_rate is transformers' cosine_with_min_lr. Oracles: Adam's update written out in
fp64, and transformers' own schedule."""

import math

import pytest
import torch
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from driver.config import Config, TrainConfig
from driver.update.optim import build_optimizer, build_scheduler

SETTINGS = {"adam_beta1": 0.5, "adam_beta2": 0.75, "adam_epsilon": 0.3}  # far from the defaults: each one shows


def adam_oracle(weight, grads, lr, beta1, beta2, eps):
    m = v = 0.0
    for step, grad in enumerate(grads, start=1):
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        weight = weight - lr * (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
    return weight


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_8bit"])
def test_betas_and_epsilon_reach_the_optimizer(optim):
    config = TrainConfig(lr=0.1, optim=optim, **SETTINGS)
    start = torch.linspace(-1, 1, 64, dtype=torch.float64)
    weight = torch.nn.Parameter(start.float().clone())
    optimizer = build_optimizer([weight], config)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"]) == ((0.5, 0.75), 0.3)
    grads = [torch.linspace(0.5, -2.0, 64, dtype=torch.float64) * (step + 1) for step in range(3)]
    for grad in grads:
        weight.grad = grad.float()
        optimizer.step()
    expected = adam_oracle(start, grads, 0.1, 0.5, 0.75, 0.3)
    # 64 elements stay in 32-bit states under bitsandbytes' min_8bit_size: its update is Adam's too
    torch.testing.assert_close(weight.detach().double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("warmup", [0, 3])
def test_cosine_min_lr_rate_is_transformers_cosine_with_min_lr(warmup):
    total = 20
    config = TrainConfig(lr=1.0, schedule="cosine", min_lr_rate=0.1, warmup_steps=warmup)
    ours = build_scheduler(build_optimizer([torch.nn.Parameter(torch.zeros(1))], config), config, total)
    theirs_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(theirs_optimizer, warmup, total, min_lr_rate=0.1)
    for update in range(total + 1):  # through the run's last update; beyond it, transformers' rises again
        if update >= warmup:  # the warm-up's own ramp is ours: (n + 1) / (warmup + 1)
            assert math.isclose(ours.get_last_lr()[0], theirs.get_last_lr()[0], rel_tol=1e-12), update
        if update < total:
            ours.optimizer.step()
            ours.step()
            theirs_optimizer.step()
            theirs.step()
    assert math.isclose(ours.get_last_lr()[0], 0.1)


def test_min_lr_rate_without_the_cosine_schedule_is_refused():
    with pytest.raises(ValueError, match="min_lr_rate = 0.1 is for schedule cosine, not linear"):
        Config.model_validate({"train": {"schedule": "linear", "min_lr_rate": 0.1}})
