"""Full fine-tuning checkpoints written before biases and norm weights took no weight decay (one AdamW param group,
driver/update/optim.py's old layout) resume into today's two groups (driver/distributed/no_decay_group.py), one
process's state and a torch.distributed.checkpoint one alike: every weight keeps its own AdamW moments, step count
(and fp32 master) by name, both groups take the saved group's settings, the second without decay. Without the
split torch refuses the first ("a different number of parameter groups") and DCP the second (a missing key).
The torchrun path that loads a one-process state on several ranks splits the same way before it
(driver/checkpoint.py), with the sharding itself tested in tests/driver/distributed/test_driver_fsdp_full_model.py."""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from driver.checkpoint import STATE_FILE, load_checkpoint, load_state, save_checkpoint
from driver.config import Config
from driver.data.tiny_model import build_tiny_model
from driver.distributed import fsdp
from driver.distributed.no_decay_group import split_saved_group
from driver.policy.model import Policy
from driver.update import optim

WEIGHT_DECAY = 0.1
SCHEDULED_LR = 0.3  # the schedule's learning rate when the old checkpoint was saved: it resumes in both groups


def full_model_policy(dtype: torch.dtype) -> Policy:
    path = build_tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(path), model_dir=str(path), dtype=dtype)


def optimizer_of(policy: Policy, one_group: bool, monkeypatch) -> torch.optim.Optimizer:
    train = Config.model_validate({"train": {"lr": 1e-3, "weight_decay": WEIGHT_DECAY}}).train
    with monkeypatch.context() as patch:
        if one_group:  # the old build: no weight exempt from decay
            patch.setattr(optim, "undecayed", lambda model, parameters: set())
        return optim.build_optimizer(policy.trainable_parameters(), train, model=policy.model)


def names_of_stepped(policy: Policy, optimizer) -> dict[int, str]:
    """The weight name of each tensor the optimizer steps (the weights, or their fp32 masters in the same order)."""
    tensors = getattr(optimizer, "masters", policy.trainable_parameters())
    return {id(tensor): name for (name, _), tensor in zip(policy.model.named_parameters(), tensors, strict=True)}


def state_by_name(policy: Policy, optimizer) -> dict[str, dict]:
    names = names_of_stepped(policy, optimizer)
    return {names[id(tensor)]: {key: value.clone() for key, value in state.items()}
            for tensor, state in optimizer.state.items()}


@pytest.mark.parametrize(("dtype", "sharded"), [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.float32, True)])
def test_a_checkpoint_of_one_param_group_resumes_into_the_no_decay_group(tmp_path, monkeypatch, dtype, sharded):
    """sharded: the optimizer state as torchrun writes it (DCP, by weight name, with the weights; here from one
    process) in place of trainer_state.pt's; bfloat16: the fp32 master weights' optimizer (train.master_weights)."""
    old_policy = full_model_policy(dtype)
    old = optimizer_of(old_policy, one_group=True, monkeypatch=monkeypatch)
    assert len(old.param_groups) == 1
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):  # moments that differ weight by weight
        for parameter in old_policy.trainable_parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator).to(dtype)
        old.step()
    old.param_groups[0]["lr"] = SCHEDULED_LR
    scheduler = torch.optim.lr_scheduler.LambdaLR(old, lambda _: 1.0)
    saved = save_checkpoint(tmp_path, 2, old_policy, old, scheduler, types.SimpleNamespace(state_dict=dict), keep=1)
    if sharded:
        state = load_state(saved / STATE_FILE)
        del state["optimizer"]
        torch.save(state, saved / STATE_FILE)
        fsdp.save_optimizer(saved, old_policy.model, old, with_weights=True)

    policy = full_model_policy(dtype)
    optimizer = optimizer_of(policy, one_group=False, monkeypatch=monkeypatch)
    groups = [[id(tensor) for tensor in group["params"]] for group in optimizer.param_groups]
    step, _ = load_checkpoint(saved, policy, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
                              None)

    assert step == 2
    assert [[id(tensor) for tensor in group["params"]] for group in optimizer.param_groups] == groups
    names = names_of_stepped(policy, optimizer)
    exempt = {names[tensor] for tensor in groups[1]}
    assert {"model.norm.weight", "model.layers.0.self_attn.q_proj.bias"} <= exempt
    assert "model.layers.0.self_attn.q_proj.weight" not in exempt
    assert [(group["weight_decay"], group["lr"]) for group in optimizer.param_groups] == [
        (WEIGHT_DECAY, SCHEDULED_LR), (0.0, SCHEDULED_LR)]
    expected, resumed = state_by_name(old_policy, old), state_by_name(policy, optimizer)
    assert resumed.keys() == expected.keys() == set(names.values())
    for name, state in expected.items():
        for key, value in state.items():
            assert torch.equal(resumed[name][key], value), (name, key)
    if dtype == torch.bfloat16:
        for master, old_master in zip(optimizer.masters, old.masters, strict=True):
            assert torch.equal(master, old_master)
    for parameter in policy.trainable_parameters():  # and it steps on
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    assert {int(state["step"]) for state in state_by_name(policy, optimizer).values()} == {3}


def test_a_state_with_the_groups_of_the_optimizer_is_left_as_it_is(monkeypatch):
    policy = full_model_policy(torch.float32)
    optimizer = optimizer_of(policy, one_group=False, monkeypatch=monkeypatch)
    state = optimizer.state_dict()
    assert split_saved_group(state, optimizer, policy.trainable_parameters()) is state
