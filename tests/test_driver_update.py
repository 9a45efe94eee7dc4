"""The update step on a real (tiny) policy, without vLLM: micro-batch invariance, zero-advantage
skipping, the KL reference and num_iterations."""

import copy

import pytest
import torch

from driver.batch import RolloutBatch
from driver.config import Config
from driver.model import load_policy
from driver.optim import build_optimizer, build_scheduler
from driver.scoring import completion_logprobs, pack
from driver.update import optimize


@pytest.fixture(scope="module")
def base_policy():
    config = Config.model_validate({"lora": {"r": 4}})
    return load_policy(config)


def make_batch(policy, advantages, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 2, 4, 1, 6, 3, 2]
    prompts = [[10 + i, 20, 30 + i] for i in range(8)]
    completions = [torch.randint(40, 300, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        logps, _, mask = completion_logprobs(policy.model, pack(prompts, completions))
    return RolloutBatch(prompts, completions, logps.clone(), mask, torch.tensor(advantages, dtype=torch.float32))


def run_update(policy, batch, **overrides):
    policy = copy.deepcopy(policy)
    config = Config.model_validate({"lora": {"r": 4}, **overrides})
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 10)
    metrics = optimize(config, policy, batch, optimizer, scheduler)
    return policy, metrics


def adapter_grads(policy):
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad and p.grad is not None}


ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.0, 0.7, -0.3, 0.9]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradients_do_not_depend_on_the_micro_batch_split(base_policy, loss_type):
    # A non-zero lora_B so that gradients reach lora_A too.
    torch.manual_seed(0)
    for name, param in base_policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(base_policy, ADVANTAGES)
    whole, whole_metrics = run_update(base_policy, batch, train={"micro_batch_size": 8, "lr": 1e-9},
                                      algo={"loss_type": loss_type})
    split, split_metrics = run_update(base_policy, batch, train={"micro_batch_size": 3, "lr": 1e-9},
                                      algo={"loss_type": loss_type})
    grads_whole, grads_split = adapter_grads(whole), adapter_grads(split)
    assert grads_whole.keys() == grads_split.keys() and grads_whole
    for name in grads_whole:
        torch.testing.assert_close(grads_split[name], grads_whole[name], atol=1e-6, rtol=1e-4)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], abs=1e-6)


def test_all_zero_advantages_skip_every_micro_batch_and_leave_the_adapter(base_policy):
    batch = make_batch(base_policy, [0.0] * 8)
    before = {n: p.detach().clone() for n, p in base_policy.model.named_parameters() if p.requires_grad}
    updated, metrics = run_update(base_policy, batch, train={"micro_batch_size": 3})
    assert metrics["skipped_micro_batch_fraction"] == 1.0 and metrics["grad_norm"] == 0.0
    for name, param in updated.model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and not param.grad.any(), name  # connected, zero
            torch.testing.assert_close(param.detach(), before[name])


def test_kl_term_keeps_zero_advantage_batches(base_policy):
    torch.manual_seed(1)
    for name, param in base_policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(base_policy, [0.0] * 8)
    _, metrics = run_update(base_policy, batch, algo={"beta": 0.1})
    assert metrics["skipped_micro_batch_fraction"] == 0.0
    assert metrics["kl"] > 0 and metrics["grad_norm"] > 0


def test_num_iterations_takes_several_updates_against_fixed_old_logprobs(base_policy):
    batch = make_batch(base_policy, ADVANTAGES)
    once, _ = run_update(base_policy, batch, algo={"num_iterations": 1})
    twice, metrics = run_update(base_policy, batch, algo={"num_iterations": 2})
    changed = [n for (n, a), (_, b) in zip(once.model.named_parameters(), twice.model.named_parameters())
               if a.requires_grad and not torch.equal(a, b)]
    assert changed and metrics["learning_rate"] > 0


def test_moe_qlora_policy_trains_expert_lora_on_nf4_experts():
    from pykernels.nn import NF4ExpertWeight, NF4Linear

    overrides = {"model": {"path": "tiny://qwen3-moe", "qlora": True},
                 "lora": {"r": 4, "targets": ["q_proj", "v_proj"],
                          "expert_targets": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}}
    policy = load_policy(Config.model_validate(overrides))
    modules = list(policy.model.modules())
    assert sum(isinstance(m, NF4ExpertWeight) for m in modules) == 4 and any(isinstance(m, NF4Linear) for m in modules)
    assert "grouped MoE kernels on 2 experts modules" in policy.kernels
    torch.manual_seed(0)
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    batch = make_batch(policy, ADVANTAGES)
    updated, metrics = run_update(policy, batch, **overrides, train={"micro_batch_size": 3}, algo={"beta": 0.04})
    grads = adapter_grads(updated)
    expert_grads = [g for n, g in grads.items() if "experts" in n]
    assert len(expert_grads) == 8 and all(g.abs().sum() > 0 for g in expert_grads)  # A and B, 2 params, 2 layers
    assert metrics["grad_norm"] > 0
