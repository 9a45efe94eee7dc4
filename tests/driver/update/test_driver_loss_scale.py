"""model.dtype float16 trains with dynamic loss scaling (driver/update/loss_scale.py). Oracles: torch's own
GradScaler for the schedule (scale, skipped steps, growth), and the fp32 model's gradients for what the scale is
for: a float16 backward of a GRPO loss whose gradients are small loses them unscaled and keeps them scaled."""

import copy
import math

import pytest
import torch

from driver.checkpoint import load_checkpoint, save_checkpoint
from driver.config import Config
from driver.metrics.combine import Metrics
from driver.policy.model import load_policy
from driver.update.loss_scale import GOOD_UPDATES, SCALE, loss_scale
from driver.update.optim import build_optimizer, build_scheduler, optimizer_steps
from driver.update.step import update_pass
from tests.driver.policy.test_driver_full_finetuning import NoData
from tests.driver.update.test_driver_update import make_batch

FP16 = {"model": {"dtype": "float16"}, "lora": {"r": 4}}


def test_the_schedule_is_gradscalers():
    """Updates with finite gradients and with overflowing ones, run through optimizer_steps and through
    torch.amp.GradScaler with the same optimizer: the same scale before every update, the same updates skipped
    (weights unchanged), the scale doubled after 2000 good updates in a row, the same weights at the end."""
    config = Config.model_validate({"model": {"dtype": "float16"}, "train": {"max_grad_norm": None, "lr": 1e-3}})
    ours, theirs = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizer, oracle = torch.optim.SGD([ours], lr=1e-3), torch.optim.SGD([theirs], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    overflows = {0, 1, 5, 2100}  # at the start (the scale too high), one later, one after a growth
    steps = []

    def backward_pass(overflow):
        def run():
            scale = loss_scale(config, optimizer)
            steps.append(scale)
            value = math.inf if overflow else 1.0
            (ours * torch.tensor([value, 2.0, 3.0])).sum().mul(scale).backward()
            return Metrics({})
        return run

    for update in range(2110):
        overflow = update in overflows
        before = ours.detach().clone()
        metrics = optimizer_steps(config, [ours], optimizer, scheduler, [backward_pass(overflow)])
        assert metrics.values["skipped_update_fraction"] == float(overflow)
        assert ("grad_norm" in metrics.values) != overflow
        assert torch.equal(ours.detach(), before) == overflow

        oracle.zero_grad()
        assert steps[-1] == scaler.get_scale(), update
        scaler.scale((theirs * torch.tensor([math.inf if overflow else 1.0, 2.0, 3.0])).sum()).backward()
        scaler.step(oracle)
        scaler.update()
        assert metrics.values["loss_scale"] == scaler.get_scale()
    # halved at updates 0, 1 and 5, doubled after 2000 good ones (6 to 2005), halved at 2100
    assert (steps[0], steps[6], steps[2006], steps[2101]) == (2.0 ** 16, 2.0 ** 13, 2.0 ** 14, 2.0 ** 13)
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-6)
    assert scheduler.last_epoch == 2110 - len(overflows)  # the schedule steps with the optimizer only


def test_bfloat16_and_float32_are_not_scaled():
    for dtype in ("bfloat16", "float32"):
        config = Config.model_validate({"model": {"dtype": dtype}})
        parameter = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([parameter], lr=0.1)
        assert loss_scale(config, optimizer) == 1.0

        def backward_pass(parameter=parameter):
            parameter.sum().backward()
            return Metrics({})

        metrics = optimizer_steps(config, [parameter], optimizer,
                                  torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), [backward_pass])
        assert set(metrics.values) == {"grad_norm"} and SCALE not in optimizer.param_groups[0]


@pytest.fixture(scope="module")
def policies():
    """The fp32 policy with a non-zero lora_B (gradients reach lora_A), and the float16 one with its adapter."""
    fp32 = load_policy(Config.model_validate({"lora": {"r": 4}}))
    torch.manual_seed(0)
    for name, param in fp32.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    fp16 = load_policy(Config.model_validate(FP16))
    fp16.model.load_state_dict({name: value for name, value in fp32.model.state_dict().items() if "lora_" in name},
                               strict=False)
    return fp32, fp16


def update_gradients(policy, config, batch, scale=None):
    """The adapter's gradients of one update as optimizer_steps hands them to the optimizer (unscaled), with
    the float16 loss scale at `scale` (None: the schedule's start)."""
    policy = copy.deepcopy(policy)
    params = policy.trainable_parameters()
    captured = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            captured.update({id(p): p.grad.double().clone() for p in params})

    capture = Capture(params, lr=0.0)
    if scale is not None:
        capture.param_groups[0].update({SCALE: scale, GOOD_UPDATES: 0})
    pass_ = update_pass(config, policy, batch, params, [], optimizer=capture)
    optimizer_steps(config, params, capture, build_scheduler(capture, config.train, 4), [pass_])
    return [captured[id(p)] for p in params]


def relative_error(grads, expected):
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g - e) for g, e in
                                                       zip(grads, expected, strict=True)]))
                 / torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(e) for e in expected])))


def test_a_float16_backward_keeps_small_gradients_only_scaled(policies):
    """A GRPO update whose loss gradients are ~1e-6 (small advantages): float16 activations' gradients fall below
    its subnormals (6e-8) and vanish unscaled; scaled by 2^16 they are kept, and the adapter's gradients are the
    fp32 model's to float16's precision."""
    fp32, fp16 = policies
    advantages = [a * 1e-5 for a in (1.0, -0.5, 0.25, -1.0, 0.4, 0.7, -0.3, 0.9)]
    batch = make_batch(fp32, advantages)
    config = Config.model_validate({**FP16, "train": {"max_grad_norm": None, "micro_batch_size": 3}})
    expected = update_gradients(fp32, Config.model_validate({"lora": {"r": 4}, "train": config.train.model_dump()}),
                                batch)
    scaled = relative_error(update_gradients(fp16, config, batch), expected)
    unscaled = relative_error(update_gradients(fp16, config, batch, scale=1.0), expected)
    assert scaled < 0.02
    assert unscaled > 0.5


def test_the_scale_resumes_from_a_checkpoint(policies, tmp_path):
    """The scale and its count of good updates are in the optimizer's state: a resume continues them."""
    _, fp16 = policies
    config = Config.model_validate(FP16)
    policy = copy.deepcopy(fp16)
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 4)
    optimizer.param_groups[0].update({SCALE: 512.0, GOOD_UPDATES: 17})

    path = save_checkpoint(tmp_path, 1, policy, optimizer, scheduler, NoData(), keep=1)
    fresh = copy.deepcopy(fp16)
    resumed = build_optimizer(fresh.trainable_parameters(), config.train)
    load_checkpoint(path, fresh, resumed, build_scheduler(resumed, config.train, 4), NoData())
    assert loss_scale(config, resumed) == 512.0 and resumed.param_groups[0][GOOD_UPDATES] == 17


def test_float16_full_fine_tuning_steps_its_fp32_masters_through_the_scale(tmp_path):
    """Every weight in float16 (master weights, their gradients summed in fp32 and unscaled there): the updates
    step at the starting scale (none overflows here), the masters move and the model holds them rounded."""
    from driver.update.step import optimize

    config = Config.model_validate({"model": {"adapter": "none", "dtype": "float16"},
                                    "train": {"lr": 1e-5, "micro_batch_size": 3}})
    policy = load_policy(config)
    before = [p.detach().float().clone() for p in policy.trainable_parameters()]
    optimizer = build_optimizer(policy.trainable_parameters(), config.train)
    scheduler = build_scheduler(optimizer, config.train, 4)
    batch = make_batch(policy, [1.0, -0.5, 0.25, -1.0, 0.3, 0.7, -0.3, 0.9])
    metrics = [optimize(config, policy, batch, optimizer, scheduler) for _ in range(3)]
    for values in metrics:
        assert values["loss_scale"] == 2.0 ** 16 and values["skipped_update_fraction"] == 0.0
        assert 1.0 < values["grad_norm"] < 100.0  # unscaled: the scale would make it 2^16 times that
    masters = optimizer.masters
    moved = sum(int((m.detach() != b).sum()) for m, b in zip(masters, before, strict=True))
    assert moved > 0.5 * sum(m.numel() for m in masters)
    for weight, master in zip(policy.trainable_parameters(), masters, strict=True):
        assert weight.dtype == torch.float16 and torch.equal(weight.detach(), master.detach().to(torch.float16))


def test_torchrun_s_sharded_checkpoint_resumes_it_when_the_run_sets_it_up_first(tmp_path):
    """torch.distributed.checkpoint loads the parameter-group keys the optimizer already has: driver/train.py
    starts the scale (start_loss_scale) before a resume, as here (one process: the same calls)."""
    from driver.distributed.fsdp import load_optimizer, save_optimizer
    from driver.update.loss_scale import start_loss_scale

    config = Config.model_validate({"model": {"dtype": "float16"}})
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    optimizer.param_groups[0].update({SCALE: 256.0, GOOD_UPDATES: 3})
    save_optimizer(tmp_path, model, optimizer)
    resumed = torch.optim.AdamW(model.parameters())
    start_loss_scale(config, resumed)
    load_optimizer(tmp_path, model, resumed)
    assert (resumed.param_groups[0][SCALE], resumed.param_groups[0][GOOD_UPDATES]) == (256.0, 3)
    not_started = torch.optim.AdamW(model.parameters())
    start_loss_scale(Config(), not_started)  # float32: no scale, no keys
    assert SCALE not in not_started.param_groups[0]


def test_a_run_whose_gradients_overflow_at_every_scale_stops_and_says_why():
    """17 overflows in a row take the scale from 2^16 below 1: the update raises what driver/train.py reports
    in one line, instead of skipping every update while the run looks alive."""
    from driver.update.loss_scale import LossScaleError

    config = Config.model_validate({"model": {"dtype": "float16"}})
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def nan_pass():
        (parameter * torch.tensor([math.nan, 1.0])).sum().backward()
        return Metrics({})

    for _ in range(16):
        assert optimizer_steps(config, [parameter], optimizer, scheduler, [nan_pass]).values[
            "skipped_update_fraction"] == 1.0
    assert loss_scale(config, optimizer) == 1.0
    with pytest.raises(LossScaleError, match="overflowed at every loss scale down to 1 .* non-finite loss or weights"):
        optimizer_steps(config, [parameter], optimizer, scheduler, [nan_pass])
    assert torch.equal(parameter.detach(), torch.ones(2))  # no update ran


def test_float16_full_fine_tuning_without_master_weights_is_refused():
    with pytest.raises(ValueError, match="float16 with train.master_weights = false .* keep train.master_weights"):
        Config.model_validate({"model": {"adapter": "none", "dtype": "float16"}, "train": {"master_weights": False}})
    Config.model_validate({"model": {"adapter": "none", "dtype": "bfloat16"}, "train": {"master_weights": False}})
