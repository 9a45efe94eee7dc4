"""train.master_weights: 16-bit trainable weights are stepped as fp32 copies. The oracle is torch's AdamW on
fp64 tensors given the same (16-bit) gradients: the master weights follow it exactly and the model's weights
are those rounded; without them, AdamW at GRPO's learning rates leaves most bf16 weights where they were."""

import pytest
import torch

from driver.config import TrainConfig
from driver.update.master_weights import MasterWeightsOptimizer
from driver.update.optim import build_optimizer, build_scheduler

STEPS = 12


def bf16_weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16))
            for shape in ((37, 53), (53,), (5, 37))]


def gradients(step, weights):
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(w.shape, generator=generator).to(w.dtype) for w in weights]


def train(optimizer, weights, steps, scheduler=None, first=0):
    for step in range(first, first + steps):
        optimizer.zero_grad(set_to_none=True)
        for weight, grad in zip(weights, gradients(step, weights), strict=True):
            weight.grad = grad
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_master_weights_follow_fp32_adamw_and_the_model_holds_them_rounded(optim):
    config = TrainConfig(lr=1e-6, weight_decay=0.01, optim=optim)
    weights = bf16_weights()
    start = [w.detach().clone() for w in weights]
    optimizer = build_optimizer(weights, config)
    assert isinstance(optimizer, MasterWeightsOptimizer)
    oracle_weights = [torch.nn.Parameter(w.detach().double()) for w in weights]
    oracle = torch.optim.AdamW(oracle_weights, lr=1e-6, weight_decay=0.01)
    train(optimizer, weights, STEPS)
    for step in range(STEPS):
        for weight, grad in zip(oracle_weights, gradients(step, weights), strict=True):
            weight.grad = grad.double()
        oracle.step()
    for weight, master, expected, before in zip(weights, optimizer.masters, oracle_weights, start, strict=True):
        assert master.dtype == torch.float32 and weight.dtype == torch.bfloat16
        # fp32 rounding: ~10 ulps of a 0.02 weight after 12 steps, 0.2% of the 1.2e-5 the weights move
        torch.testing.assert_close(master.double(), expected.detach(), rtol=0, atol=5e-8)
        assert torch.equal(weight.detach(), master.detach().to(torch.bfloat16))
        assert (master.detach() != before.float()).float().mean() > 0.99  # every master moved


def test_without_master_weights_bf16_adamw_loses_most_updates():
    """Why the switch exists: the same steps on the bf16 weights themselves move few of them."""
    weights = bf16_weights()
    start = [w.detach().clone() for w in weights]
    optimizer = build_optimizer(weights, TrainConfig(lr=1e-6, master_weights=False))
    assert not isinstance(optimizer, MasterWeightsOptimizer)
    train(optimizer, weights, STEPS)
    moved = sum((w.detach() != b).sum().item() for w, b in zip(weights, start, strict=True))
    assert moved < 0.1 * sum(w.numel() for w in weights)


def test_fp32_weights_and_adapters_get_a_plain_optimizer():
    weights = [torch.nn.Parameter(torch.randn(4, 4))]
    assert isinstance(build_optimizer(weights, TrainConfig()), torch.optim.AdamW)


def test_a_resume_continues_from_the_master_weights_with_the_schedule_and_param_group_keys():
    """A checkpoint's state_dict into a fresh optimizer over the saved (rounded) model weights: the run goes on
    as if uninterrupted (the masters, not the rounded weights, continue); the schedule and a key algo.
    use_adaptive_entropy keeps in param_groups[0] survive."""
    config = TrainConfig(lr=1e-4, schedule="linear")
    whole = bf16_weights()
    optimizer = build_optimizer(whole, config)
    scheduler = build_scheduler(optimizer, config, total_updates=2 * STEPS)
    train(optimizer, whole, 2 * STEPS, scheduler)

    halves = bf16_weights()
    first = build_optimizer(halves, config)
    first_scheduler = build_scheduler(first, config, total_updates=2 * STEPS)
    train(first, halves, STEPS, first_scheduler)
    first.param_groups[0]["adaptive_entropy_coef"] = 0.25
    saved = {"optimizer": first.state_dict(), "scheduler": first_scheduler.state_dict(),
             "weights": [w.detach().clone() for w in halves]}

    resumed_weights = [torch.nn.Parameter(w) for w in saved["weights"]]
    resumed = build_optimizer(resumed_weights, config)
    resumed.param_groups[0]["adaptive_entropy_coef"] = None  # train.py's controller sets its keys before a resume
    resumed_scheduler = build_scheduler(resumed, config, total_updates=2 * STEPS)
    resumed.load_state_dict(saved["optimizer"])
    resumed_scheduler.load_state_dict(saved["scheduler"])
    assert resumed.param_groups[0]["adaptive_entropy_coef"] == 0.25
    train(resumed, resumed_weights, STEPS, resumed_scheduler, first=STEPS)
    assert resumed_scheduler.get_last_lr() == scheduler.get_last_lr()
    for weight, expected in zip(resumed_weights, whole, strict=True):
        assert torch.equal(weight.detach(), expected.detach())
    for master, expected in zip(resumed.masters, optimizer.masters, strict=True):
        assert torch.equal(master.detach(), expected.detach())


def test_a_state_without_master_weights_starts_them_from_the_model():
    """A checkpoint written with train.master_weights off, resumed with it on."""
    config = TrainConfig(lr=1e-3)
    weights = bf16_weights()
    plain = build_optimizer(weights, TrainConfig(lr=1e-3, master_weights=False))
    train(plain, weights, 2)
    masters = build_optimizer(weights, config)
    masters.load_state_dict(plain.state_dict())
    for weight, master in zip(weights, masters.masters, strict=True):
        assert torch.equal(master.detach(), weight.detach().float())
    assert masters.state[masters.masters[0]]["step"] == 2


def test_masters_are_saved_by_their_weights_position_and_an_older_list_still_loads():
    """A fp32 weight among 16-bit ones has no master: the saved masters name the positions of those that do (a
    sharded resume, whose weights are all fp32, reads them by position: test_driver_fsdp_full_model.py), and a
    state from before, listing them in order, loads into the same masters."""
    config = TrainConfig(lr=1e-3)
    bf16 = bf16_weights()
    weights = [bf16[0], torch.nn.Parameter(torch.randn(7)), *bf16[1:]]
    optimizer = build_optimizer(weights, config)
    train(optimizer, weights, 2)
    state = optimizer.state_dict()
    assert sorted(state["masters"]) == [0, 2, 3]
    assert all(torch.equal(state["masters"][i], optimizer.masters[i].detach()) for i in (0, 2, 3))
    older = {**state, "masters": [state["masters"][i] for i in (0, 2, 3)]}
    for saved in (state, older):
        resumed = build_optimizer([torch.nn.Parameter(w.detach().clone()) for w in weights], config)
        resumed.load_state_dict(saved)
        for master, expected in zip(resumed.masters, optimizer.masters, strict=True):
            assert torch.equal(master.detach(), expected.detach())


def micro_batch_losses(model, count=8, seed=1):
    """Losses of `count` micro-batches through a bf16 linear layer, and their gradients taken one by one (fp64)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(6, model.in_features, generator=generator).to(torch.bfloat16) for _ in range(count)]
    losses = [lambda x=x: (model(x).float() ** 2).mean() for x in inputs]
    one_by_one = [torch.autograd.grad(loss(), list(model.parameters())) for loss in losses]
    summed = [sum(grads[i].double() for grads in one_by_one) for i in range(len(one_by_one[0]))]
    return losses, summed


def bf16_linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(96, 80).to(torch.bfloat16)


def test_micro_batch_gradients_sum_in_fp32_into_the_masters():
    """Each micro-batch's bf16 gradient is added into the fp32 master's as backward makes it: the step's gradient is
    the fp32 sum of the micro-batches' (the oracle: each taken alone, summed in fp64), not the bf16 running sum, and
    no bf16 gradient is kept."""
    model = bf16_linear()
    optimizer = build_optimizer(list(model.parameters()), TrainConfig(lr=1e-6))
    losses, expected = micro_batch_losses(model)
    for loss in losses:
        loss().backward()
    assert all(p.grad is None for p in model.parameters())
    for master, summed in zip(optimizer.masters, expected, strict=True):
        assert master.grad.dtype == torch.float32
        # each addend exact in fp32 (a bf16 value), each addition rounded once to fp32
        torch.testing.assert_close(master.grad.double(), summed, rtol=1e-6, atol=1e-9)

    bf16_sum = bf16_linear()  # what accumulating in the weight's own dtype gives: the error the hook removes
    for loss in micro_batch_losses(bf16_sum)[0]:
        loss().backward()
    errors = [float((p.grad.double() - s).norm() / s.norm()) for p, s in zip(bf16_sum.parameters(), expected,
                                                                              strict=True)]
    assert min(errors) > 1e-3  # measured 0.35%


def test_clipping_takes_the_fp32_norm_and_clips_the_masters():
    """optimizer_steps clips the masters' gradients: grad_norm is the fp64 norm of the summed gradients, and the
    step is fp64 AdamW's on the clipped ones."""
    from driver.config import Config
    from driver.metrics.combine import Metrics
    from driver.update.optim import optimizer_steps

    config = Config.model_validate({"train": {"lr": 1e-3, "max_grad_norm": 0.05, "weight_decay": 0.0}})
    model = bf16_linear()
    params = list(model.parameters())
    optimizer = build_optimizer(params, config.train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    oracle_weights = [torch.nn.Parameter(p.detach().double()) for p in params]
    losses, summed = micro_batch_losses(model)

    def backward_pass():
        for loss in losses:
            loss().backward()
        return Metrics({})

    metrics = optimizer_steps(config, params, optimizer, scheduler, [backward_pass])
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(s) for s in summed])))
    assert metrics.values["grad_norm"] == pytest.approx(norm, rel=1e-6)
    assert norm > 0.05  # the clip acted
    oracle = torch.optim.AdamW(oracle_weights, lr=1e-3, weight_decay=0.0)
    for weight, grad in zip(oracle_weights, summed, strict=True):
        weight.grad = grad * (0.05 / (norm + 1e-6))
    oracle.step()
    for master, expected in zip(optimizer.masters, oracle_weights, strict=True):
        torch.testing.assert_close(master.detach().double(), expected.detach(), rtol=0, atol=1e-7)


def test_the_newest_optimizer_over_a_weight_takes_its_gradients():
    """A second optimizer built over the same weights (a test's, a rebuilt run's) gets their gradients; the first's
    hooks add nothing to it twice."""
    model = bf16_linear()
    first = build_optimizer(list(model.parameters()), TrainConfig())
    second = build_optimizer(list(model.parameters()), TrainConfig())
    losses, expected = micro_batch_losses(model, count=2)
    for loss in losses:
        loss().backward()
    assert all(master.grad is None for master in first.masters)
    for master, summed in zip(second.masters, expected, strict=True):
        torch.testing.assert_close(master.grad.double(), summed, rtol=1e-6, atol=1e-9)
    del second
    losses[0]().backward()  # its masters gone: the gradient stays on the weight, where the first's step finds it
    first.step()
    assert all(master.grad is None for master in first.masters) and all(p.grad is None for p in model.parameters())
