"""model.adapter: none (full fine-tuning) on the tiny models: every weight trains, the KL reference is a
frozen copy of the base (only when a KL term needs it), the trained model saves and loads as
transformers' own format, and what cannot go with it is refused by name. The oracle for the reference
is an untouched model loaded by transformers, scoring each row unpacked."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from driver.checkpoint import load_checkpoint, save_checkpoint
from driver.cli import ConfigError
from driver.config import Config
from driver.engine.colocate import engine_kwargs
from driver.policy.model import load_policy
from driver.update.master_weights import MasterWeightsOptimizer
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import frozen_logprobs, optimize
from tests.driver.rollouts.test_driver_filtering import make_batch

FULL = {"model": {"adapter": "none"}, "train": {"lr": 1e-3, "micro_batch_size": 3}}


def full_config(tmp_path=None, **algo):
    config = Config.model_validate({**FULL, "algo": algo})
    if tmp_path is not None:
        config.logging.output_dir = str(tmp_path)
    return config


@pytest.fixture(scope="module")
def with_kl():
    return load_policy(full_config(beta=0.04))


def row_logprobs(model, prompt, completion):
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_every_weight_trains_and_no_copy_is_made_without_a_kl_term():
    policy = load_policy(full_config())
    names = [name for name, _ in policy.model.named_parameters()]
    assert not any("lora_" in name for name in names)
    assert len(policy.trainable_parameters()) == len(names) and policy.trained_name == "model"
    assert policy.causal_lm is policy.model and policy.frozen_reference is None
    assert policy.kernels == "no LoRA or MoE layers to fuse (full fine-tuning of a dense model)"  # the start-up line
    with pytest.raises(ValueError, match="beta > 0"), policy.reference():
        pass


def test_the_kl_reference_is_the_base_after_the_policy_moved(with_kl):
    policy = copy.deepcopy(with_kl)
    config = full_config(beta=0.04)
    batch = make_batch(policy, advantages=[1.0, -0.5, 0.25, -1.0, 0.3, 0.7, -0.3, 0.9])
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    for _ in range(2):  # the second update has a KL to the base
        metrics = optimize(config, policy, batch, optimizer, build_scheduler(optimizer, config.train, 2))
    assert metrics["kl"] > 0
    assert all(not p.requires_grad for p in policy.frozen_reference.parameters())
    base = AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype=torch.float32).eval()
    rows = [slice(0, 3), slice(3, 6), slice(6, 8)]
    reference = frozen_logprobs(policy, batch, rows, 1.0, reference=True)
    current = frozen_logprobs(policy, batch, rows, 1.0, reference=False)
    with torch.no_grad():
        for row, (prompt, completion) in enumerate(zip(batch.prompt_ids, batch.completion_ids)):
            oracle = row_logprobs(base, prompt, completion)
            torch.testing.assert_close(reference[row, : len(completion)], oracle, atol=1e-5, rtol=0)
    assert float((current - reference).abs().max()) > 1e-3  # the policy itself moved away from it


class NoData:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_checkpoints_hold_the_whole_model_and_resume_it(with_kl, tmp_path):
    policy = copy.deepcopy(with_kl)
    config = full_config(tmp_path, beta=0.04)
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 4)
    optimize(config, policy, make_batch(policy), optimizer, scheduler)
    path = save_checkpoint(tmp_path, 1, policy, optimizer, scheduler, NoData(), keep=2)
    assert (path / "model" / "model.safetensors").is_file() and not (path / "adapter").exists()
    saved = AutoModelForCausalLM.from_pretrained(path / "model", dtype=torch.float32)  # transformers' own format
    fresh = copy.deepcopy(with_kl)
    fresh_optimizer = build_optimizer(fresh.trainable_parameters(), config.train)
    step, _ = load_checkpoint(path, fresh, fresh_optimizer, build_scheduler(fresh_optimizer, config.train, 4),
                              NoData())
    assert step == 1
    for (name, trained), loaded, from_disk in zip(policy.model.named_parameters(), fresh.model.parameters(),
                                                  saved.parameters()):
        assert torch.equal(trained, loaded) and torch.equal(trained, from_disk), name
    for base, kept in zip(with_kl.frozen_reference.parameters(), fresh.frozen_reference.parameters()):
        assert torch.equal(base, kept)  # the reference stays the base, not the checkpoint's weights

    lora = load_policy(Config.model_validate({"lora": {"r": 4}}))
    lora_optimizer = build_optimizer(lora.trainable_parameters(), config.train)
    with pytest.raises(ValueError, match="no adapter/ but a model/: it was written with model.adapter = none"):
        load_checkpoint(path, lora, lora_optimizer, build_scheduler(lora_optimizer, config.train, 4), NoData())


def test_the_engine_gets_no_lora_slots():
    kwargs = engine_kwargs(full_config(), "/some/model")
    assert "enable_lora" not in kwargs and "max_loras" not in kwargs
    assert engine_kwargs(Config(), "/some/model")["enable_lora"] is True


@pytest.mark.parametrize(("overrides", "named"), [
    ({"model": {"qlora": True}}, "model.qlora"),
    ({"rollout": {"sync": "lora"}}, "rollout.sync = lora"),
])
def test_what_cannot_go_with_full_finetuning_is_named(overrides, named):
    merged = {**FULL, **{key: {**FULL.get(key, {}), **value} for key, value in overrides.items()}}
    with pytest.raises(ValueError, match=f"model.adapter = none .*{named}"):
        Config.model_validate(merged)


def test_moe_models_are_refused_with_the_way_out():
    with pytest.raises(ConfigError, match="mixture of experts: train it with LoRA"):
        load_policy(Config.model_validate({**FULL, "model": {"adapter": "none", "path": "tiny://qwen3-moe"}}))


def test_bf16_weights_train_through_fp32_master_weights_and_a_resume_keeps_them(tmp_path):
    """train.master_weights (default): at a learning rate whose updates are below the bf16 weights' rounding
    step, the model's weights are the fp32 masters rounded, the masters moved, and a checkpoint resumes the
    masters themselves (driver/update/master_weights.py; its oracle tests: tests/driver/update)."""
    config = Config.model_validate({**FULL, "model": {"adapter": "none", "dtype": "bfloat16"},
                                    "train": {"lr": 1e-6, "micro_batch_size": 3}})
    config.logging.output_dir = str(tmp_path)
    policy = load_policy(config)
    before = [p.detach().float().clone() for p in policy.trainable_parameters()]
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    assert isinstance(optimizer, MasterWeightsOptimizer)
    scheduler = build_scheduler(optimizer, config.train, 4)
    batch = make_batch(policy, advantages=[1.0, -0.5, 0.25, -1.0, 0.3, 0.7, -0.3, 0.9])
    for _ in range(2):
        optimize(config, policy, batch, optimizer, scheduler)
    masters = [m.detach().clone() for m in optimizer.masters]
    moved = sum(int((m != b).sum()) for m, b in zip(masters, before, strict=True))
    assert moved > 0.5 * sum(m.numel() for m in masters)
    for weight, master in zip(policy.trainable_parameters(), masters, strict=True):
        assert weight.dtype == torch.bfloat16 and torch.equal(weight.detach(), master.to(torch.bfloat16))
    path = save_checkpoint(tmp_path, 1, policy, optimizer, scheduler, NoData(), keep=2)
    fresh = load_policy(config)
    fresh_optimizer = build_optimizer(fresh.trainable_parameters(), config.train)
    load_checkpoint(path, fresh, fresh_optimizer, build_scheduler(fresh_optimizer, config.train, 4), NoData())
    for master, kept in zip(masters, fresh_optimizer.masters, strict=True):
        assert torch.equal(master, kept.detach())
