"""TRL's adam_beta1 / adam_beta2 / adam_epsilon (train.*) reach every optimizer train.optim builds, and the
schedules are transformers' (the cosine's min_lr_rate its cosine_with_min_lr) after the warm-up. Oracles:
Adam's update written out in fp64, and transformers' own schedules."""

import math

import pytest
import torch
from transformers.optimization import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                                      get_cosine_with_min_lr_schedule_with_warmup, get_linear_schedule_with_warmup)

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


SCHEDULES = {  # ours -> transformers' own
    ("constant", 0.0): lambda opt, warmup, total: get_constant_schedule_with_warmup(opt, warmup),
    ("linear", 0.0): lambda opt, warmup, total: get_linear_schedule_with_warmup(opt, warmup, total),
    ("cosine", 0.0): lambda opt, warmup, total: get_cosine_schedule_with_warmup(opt, warmup, total),
    ("cosine", 0.1): lambda opt, warmup, total: get_cosine_with_min_lr_schedule_with_warmup(
        opt, warmup, total, min_lr_rate=0.1),
}


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize(("schedule", "min_lr_rate"), list(SCHEDULES))
def test_schedules_are_transformers_after_the_warm_up(schedule, min_lr_rate, warmup):
    """transformers' schedule through the run's last update (beyond it, its cosine rises again); during the
    warm-up ours is (n + 1) / (warmup + 1), where transformers' first update is at lr 0
    (docs/trl-differences.md)."""
    total = 20
    config = TrainConfig(lr=1.0, schedule=schedule, min_lr_rate=min_lr_rate, warmup_steps=warmup)
    ours = build_scheduler(build_optimizer([torch.nn.Parameter(torch.zeros(1))], config), config, total)
    theirs_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = SCHEDULES[schedule, min_lr_rate](theirs_optimizer, warmup, total)
    for update in range(total + 1):
        expected = (update + 1) / (warmup + 1) if update < warmup else theirs.get_last_lr()[0]
        assert math.isclose(ours.get_last_lr()[0], expected, rel_tol=1e-12), update
        if update < total:
            ours.optimizer.step()
            ours.step()
            theirs_optimizer.step()
            theirs.step()
    final = {"constant": 1.0, "linear": 0.0, "cosine": min_lr_rate}[schedule]
    assert math.isclose(ours.get_last_lr()[0], final, abs_tol=1e-12)


def test_min_lr_rate_without_the_cosine_schedule_is_refused():
    with pytest.raises(ValueError, match="min_lr_rate = 0.1 is for schedule cosine, not linear"):
        Config.model_validate({"train": {"schedule": "linear", "min_lr_rate": 0.1}})


@pytest.mark.parametrize("master_weights", [False, True])
def test_biases_and_norm_weights_take_no_weight_decay_as_in_trl(master_weights):
    """Full fine-tuning with weight_decay: the decayed weights are those transformers' Trainer decays
    (get_decay_parameter_names: no bias, no norm weight); one step with zero gradients shrinks them by
    1 - lr x weight_decay and leaves the others. An adapter (no bias, no norm) stays one group."""
    from transformers import Trainer

    from driver.policy.model import load_policy

    config = Config.model_validate({"model": {"adapter": "none", "dtype": "bfloat16" if master_weights else "float32"},
                                    "train": {"lr": 0.5, "weight_decay": 0.1, "master_weights": master_weights}})
    policy = load_policy(config)
    model = policy.model
    expected = set(Trainer.get_decay_parameter_names(None, model))  # the method reads no attribute of the trainer
    assert expected and len(expected) < len(list(model.parameters()))  # this model has both kinds
    before = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(policy.trainable_parameters(), config.train, model=model)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    for parameter in policy.trainable_parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    for name, parameter in model.named_parameters():
        factor = 1 - 0.5 * 0.1 if name in expected else 1.0
        expected_value = (before[name].double() * factor).to(parameter.dtype)
        torch.testing.assert_close(parameter.detach(), expected_value, rtol=2e-7, atol=0, msg=name)

    lora = load_policy(Config.model_validate({"train": {"weight_decay": 0.1}}))
    lora_optimizer = build_optimizer(lora.trainable_parameters(), config.train, model=lora.model)
    assert [group["weight_decay"] for group in lora_optimizer.param_groups] == [0.1]
