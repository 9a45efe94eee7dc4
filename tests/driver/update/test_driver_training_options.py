"""train.optim (torch's AdamW, fused or not, bitsandbytes' 8-bit) against torch's AdamW as the oracle,
and model.gradient_checkpointing, whose gradients must equal the plain backward's; the new loss
options through the real update (entropy bonus, top_entropy_quantile) on the tiny policy."""

import warnings

import pytest
import torch

from driver.config import Config, TrainConfig
from driver.policy.model import load_policy
from driver.update.optim import build_optimizer
from tests.driver.update.test_driver_update import ADVANTAGES, adapter_grads, make_batch, run_update


def adam_steps(optim: str, steps: int = 3) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(96, 64, generator=generator))  # 6144 elements: 8-bit states
    optimizer = build_optimizer([param], TrainConfig(optim=optim, lr=1e-2, weight_decay=0.1))
    for _ in range(steps):
        param.grad = torch.randn(96, 64, generator=generator)
        optimizer.step()
    return param.detach(), optimizer


def test_torch_adamw_fused_and_foreach_agree():
    reference, _ = adam_steps("adamw_torch")
    fused, optimizer = adam_steps("adamw_torch_fused")
    assert optimizer.defaults["fused"] is True
    torch.testing.assert_close(fused, reference, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("optim", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_adamw_keeps_8bit_states_and_follows_adamw(optim):
    pytest.importorskip("bitsandbytes")
    start, _ = adam_steps("adamw_torch", steps=0)
    reference, _ = adam_steps("adamw_torch")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU")  # paged: CUDA only
        eight_bit, optimizer = adam_steps(optim)
    state = next(iter(optimizer.state.values()))
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    moved, expected = eight_bit - start, reference - start
    # Quantized moments: the update differs from AdamW's by a few percent of its size, not more.
    assert (moved - expected).norm() < 0.05 * expected.norm()


@pytest.fixture(scope="module")
def policies():
    plain = load_policy(Config.model_validate({"lora": {"r": 4}}))
    checkpointed = load_policy(Config.model_validate({"lora": {"r": 4}, "model": {"gradient_checkpointing": True}}))
    return plain, checkpointed


def test_gradient_checkpointing_gives_the_same_gradients(policies):
    plain, checkpointed = policies
    assert checkpointed.model.base_model.model.model.gradient_checkpointing
    assert not plain.model.base_model.model.model.gradient_checkpointing
    batch = make_batch(plain, ADVANTAGES)
    grads = [adapter_grads(run_update(policy, batch, train={"micro_batch_size": 3})[0]) for policy in policies]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


def test_entropy_bonus_and_top_entropy_quantile_change_the_update(policies):
    """Through the real model: the bonus adds the entropy's gradient (so the update differs even with all
    advantages zero, where the policy term is 0 and filtering/skipping must not drop the rows), and the
    quantile trains fewer tokens."""
    plain, _ = policies
    zero = make_batch(plain, [0.0] * 8)
    policy, metrics = run_update(plain, zero, algo={"entropy_coef": 0.1, "zero_advantage": "skip"})
    assert metrics["skipped_micro_batch_fraction"] == 0  # the entropy term acts on every row
    assert any(grad.abs().sum() > 0 for grad in adapter_grads(policy).values())
    batch = make_batch(plain, ADVANTAGES)
    everything = adapter_grads(run_update(plain, batch)[0])
    top = adapter_grads(run_update(plain, batch, algo={"top_entropy_quantile": 0.2})[0])
    assert any(not torch.allclose(top[name], everything[name]) for name in everything)
