"""algo.use_adaptive_entropy (driver/update/entropy_control.py), against TRL's controller written out here
(GRPOTrainer: _last_world_entropy starts at inf, the bonus applies only at or below entropy_target, the coefficient
steps by entropy_coef_delta within [min, max] after each optimizer update) and against our fixed-coefficient update
(itself checked against TRL's loss): an update with the adaptive coefficient c is the update with entropy_coef = c.
The state rides in the optimizer's state_dict, so a checkpoint resumes it."""

import copy
import math

import pytest
import torch

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.update.entropy_control import COEF, LAST_ENTROPY, applied_entropy_coef, observe_entropy
from driver.update.optim import build_scheduler
from driver.update.step import optimize
from tests.driver.rollouts.test_driver_filtering import make_base_policy, make_batch

LR = 0.5  # plain SGD, as tests/driver/update/test_driver_steps_per_generation.py


@pytest.fixture(scope="module")
def base_policy():
    return make_base_policy()


def config_of(**algo) -> Config:
    return Config.model_validate({"lora": {"r": 4}, "train": {"micro_batch_size": 4, "lr": LR},
                                  "algo": {"loss_type": "dapo", "zero_advantage": "keep", **algo}})


def trl_controller(coef: float, entropies: list[float], target: float, delta: float, low: float, high: float):
    """TRL's: (coefficient applied to each update, coefficient after each)."""
    last, applied, after = math.inf, [], []
    for entropy in entropies:
        applied.append(coef if last <= target else 0.0)
        coef = min(coef + delta, high) if entropy <= target else max(coef - delta, low)
        last = entropy
        after.append(coef)
    return applied, after


def test_the_controller_follows_trl_s_recurrence_with_its_bounds():
    entropies = [0.1, 0.15, 0.3, 0.05, 0.5, 0.5, 0.5, 0.2]
    config = config_of(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.02, entropy_target=0.2,
                       entropy_coef_min=0.005, entropy_coef_max=0.04)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    applied, after = [], []
    for entropy in entropies:
        applied.append(applied_entropy_coef(config.algo, optimizer))
        after.append(observe_entropy(config.algo, optimizer, entropy))
    expected_applied, expected_after = trl_controller(0.01, entropies, 0.2, 0.02, 0.005, 0.04)
    assert applied == pytest.approx(expected_applied) and after == pytest.approx(expected_after)
    assert expected_applied[0] == 0.0 and max(expected_after) == 0.04 and min(expected_after) == 0.005  # clamped
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)  # a resume: the state comes back
    fresh.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert (fresh.param_groups[0][COEF], fresh.param_groups[0][LAST_ENTROPY]) == (after[-1], entropies[-1])
    assert applied_entropy_coef(config.algo, fresh) == after[-1]


def run(policy, batch, config, optimizer_state=None):
    policy = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=LR)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    scheduler = build_scheduler(optimizer, config.train, config.optimizer_updates)
    metrics = optimize(config, policy, batch, optimizer, scheduler)
    return policy, optimizer, metrics


def weights(policy) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in policy.model.named_parameters()
            if parameter.requires_grad}


def test_each_update_trains_with_the_coefficient_the_last_one_left(base_policy):
    batch = make_batch(base_policy)
    adaptive = config_of(use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.1, entropy_target=50.0)
    # First update: no measurement yet, no bonus, as entropy_coef = 0.
    first, optimizer, metrics = run(base_policy, batch, adaptive)
    without_bonus, _, _ = run(base_policy, batch, config_of(entropy_coef=0.0))
    for name, value in weights(first).items():
        torch.testing.assert_close(value, weights(without_bonus)[name], rtol=0, atol=0)
    group = optimizer.param_groups[0]
    assert group[LAST_ENTROPY] == pytest.approx(metrics["entropy"], rel=1e-6)  # the update's mean token entropy
    assert group[COEF] == pytest.approx(0.4) and metrics["entropy_coef"] == pytest.approx(0.4)  # below: up
    # Second update from there: the bonus at 0.4, exactly the fixed-coefficient update with entropy_coef = 0.4.
    state = copy.deepcopy(optimizer.state_dict())
    second, optimizer, _ = run(first, batch, adaptive, state)
    fixed, _, _ = run(first, batch, config_of(entropy_coef=0.4), state)
    moved = False
    for name, value in weights(second).items():
        torch.testing.assert_close(value, weights(fixed)[name], rtol=0, atol=1e-7)
        moved |= not torch.equal(value, weights(first)[name])
    assert moved
    assert optimizer.param_groups[0][COEF] == pytest.approx(0.5)
    above = config_of(use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.1, entropy_target=1e-6)
    _, optimizer, _ = run(base_policy, batch, above)  # entropy above the target: down, and no bonus next
    assert optimizer.param_groups[0][COEF] == pytest.approx(0.2) and applied_entropy_coef(above.algo, optimizer) == 0


def test_controller_keys_without_it_and_crossed_bounds_are_refused():
    with pytest.raises(ConfigError, match="entropy_target is set but use_adaptive_entropy is false"):
        load_config(None, {"algo.entropy_target": "0.5"})
    with pytest.raises(ConfigError, match="entropy_coef_min = 0.5 is above entropy_coef_max = 0.1"):
        load_config(None, {"algo.use_adaptive_entropy": "true", "algo.entropy_coef_min": "0.5",
                           "algo.entropy_coef_max": "0.1"})
    with pytest.raises(ConfigError, match="algo.use_adaptive_entropy: not supported by ebft.mode = strided"):
        load_config(None, {"algo.name": "ebft", "ebft.mode": "strided", "algo.use_adaptive_entropy": "true"})


def test_torchrun_s_sharded_checkpoint_resumes_it_when_the_run_sets_it_up_first(tmp_path):
    """torch.distributed.checkpoint loads the parameter-group keys the optimizer already has (and no other):
    driver/train.py sets the controller up before a resume, as here (one process: the same calls)."""
    from driver.distributed.fsdp import load_optimizer, save_optimizer
    from driver.update.entropy_control import controller

    algo = config_of(use_adaptive_entropy=True, entropy_coef=0.3, entropy_coef_delta=0.1, entropy_target=0.2).algo
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    observe_entropy(algo, optimizer, 0.1)
    save_optimizer(tmp_path, model, optimizer)
    resumed = torch.optim.AdamW(model.parameters())
    controller(algo, resumed)
    load_optimizer(tmp_path, model, resumed)
    assert (resumed.param_groups[0][COEF], resumed.param_groups[0][LAST_ENTROPY]) == (pytest.approx(0.4), 0.1)
