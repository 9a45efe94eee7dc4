"""algo.sync_ref_model (TR-DPO, TRL's SyncRefModelCallback + sync_target_model): under full fine-tuning, every
ref_model_sync_steps optimizer updates the KL reference becomes alpha x the policy + (1 - alpha) x itself, checked
weight by weight in fp64 against the weights before and after the update; between syncs it stays; a checkpoint keeps
the moved reference and a resume restores it (TRL's rebuilds the base). What it cannot go with is refused."""

import copy

import pytest
import torch

from driver.checkpoint import REFERENCE_FILE, load_checkpoint, save_checkpoint
from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.policy.model import load_policy
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import optimize
from tests.driver.rollouts.test_driver_filtering import make_batch

ALPHA = 0.25


def config_of(**algo) -> Config:
    return Config.model_validate({"model": {"adapter": "none"}, "train": {"lr": 1e-3, "micro_batch_size": 4},
                                  "algo": {"beta": 0.04, "sync_ref_model": True, "ref_model_mixup_alpha": ALPHA,
                                           **algo}})


@pytest.fixture(scope="module")
def policy():
    return load_policy(config_of(ref_model_sync_steps=2))


def weights(model) -> dict[str, torch.Tensor]:
    return {name: value.detach().double().clone() for name, value in model.named_parameters()}


class NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_the_reference_mixes_in_the_policy_every_sync_steps_updates_and_a_checkpoint_keeps_it(policy, tmp_path):
    policy = copy.deepcopy(policy)
    config = config_of(ref_model_sync_steps=2)
    batch = make_batch(policy, advantages=[1.0, -0.5, 0.25, -1.0, 0.3, 0.7, -0.3, 0.9])
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 4)
    base = weights(policy.frozen_reference)
    optimize(config, policy, batch, optimizer, scheduler)  # update 1: no sync
    assert all(torch.equal(base[name], value) for name, value in weights(policy.frozen_reference).items())
    optimize(config, policy, batch, optimizer, scheduler)  # update 2: the reference takes a quarter of the policy
    trained, moved = weights(policy.model), weights(policy.frozen_reference)
    assert any(not torch.equal(trained[name], base[name]) for name in base)
    for name, value in moved.items():
        torch.testing.assert_close(value, ALPHA * trained[name] + (1 - ALPHA) * base[name], rtol=0, atol=1e-6)
    assert all(not parameter.requires_grad for parameter in policy.frozen_reference.parameters())

    path = save_checkpoint(tmp_path, 2, policy, optimizer, scheduler, NoData(), keep=2)
    assert (path / REFERENCE_FILE).is_file()
    fresh = load_policy(config)
    fresh_optimizer = build_optimizer(fresh.trainable_parameters(), config.train)
    load_checkpoint(path, fresh, fresh_optimizer, build_scheduler(fresh_optimizer, config.train, 4), NoData())
    for name, value in weights(fresh.frozen_reference).items():
        assert torch.equal(value, moved[name]), name


def test_what_sync_ref_model_cannot_go_with_is_refused():
    with pytest.raises(ConfigError, match="full fine-tuning keeps .*TRL refuses sync_ref_model with PEFT"):
        load_config(None, {"algo.sync_ref_model": "true", "algo.beta": "0.04"})
    with pytest.raises(ConfigError, match="needs algo.name = grpo and beta > 0 without kl_in_reward"):
        load_config(None, {"model.adapter": "none", "algo.sync_ref_model": "true"})
    with pytest.raises(ConfigError, match="needs algo.name = grpo and beta > 0 without kl_in_reward"):
        load_config(None, {"model.adapter": "none", "algo.sync_ref_model": "true", "algo.beta": "0.04",
                           "algo.kl_in_reward": "true"})
    with pytest.raises(ConfigError, match="algo.ref_model_sync_steps is set but algo.sync_ref_model is false"):
        load_config(None, {"algo.ref_model_sync_steps": "64"})
