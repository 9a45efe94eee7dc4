"""Full fine-tuning under FSDP2 (driver/distributed/fsdp.py shard_full_model) with two real gloo processes: a bf16
model sharded as fp32 master weights trains what one process trains with train.master_weights (the oracle:
driver/update/master_weights.py's optimizer, itself tested against fp64 AdamW), the lm_head (untied, or tied to
the embeddings) included; a float16 one too, through its loss scale (driver/update/loss_scale.py: the sharded
gradients unscaled shard by shard). Each rank trains the same batch, so FSDP's averaged gradients are one
process's. Checkpoints cross over: the two ranks' sharded state resumes in one process, and one process's state
(whole, keyed by position) on two ranks, which then train on as it does.

The updates run as driver/update/step.py runs them, with forwards without gradients where a run has them (the
old logprobs before the parameters are listed, a sync probe between a backward and its optimizer step): the root
unit keeps its gathered weights after such a forward, so the parameters would list them in place of the shards,
and the next forward after the step would compute with the weights of before it, without the reshards."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from driver.config import Config
from driver.data.tiny_model import build_tiny_model
from driver.metrics.combine import Metrics
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import Policy
from driver.update.loss_scale import loss_scale
from driver.update.master_weights import MasterWeightsOptimizer
from driver.update.optim import build_optimizer, optimizer_steps
from driver.distributed.fsdp import load_optimizer
from driver.update.loss_scale import start_loss_scale
from tests.driver.distributed.test_driver_world_collectives import free_port

STEPS = 3
PROMPTS = [[5, 17, 33, 2], [9, 4], [12, 80, 7]]
COMPLETIONS = [[44, 51, 60, 3, 8], [101, 7, 7], [19, 250, 41, 6]]


def config(dtype: torch.dtype = torch.bfloat16) -> Config:
    config = Config()
    config.model.dtype = str(dtype).removeprefix("torch.")
    config.train.lr, config.train.weight_decay = 2e-3, 0.01
    # No clipping: both take the norm of the fp32 gradients (one process its masters', FSDP its shards', over every
    # rank's: a rank's own would be ~1/sqrt(2) of it), but summed in another order they differ by ~1e-6, and clip
    # coefficients that far apart move a few masters across a bf16 rounding boundary, after which the bf16 forwards
    # differ (measured: up to 2e-4 on a bias after 3 updates). Unclipped, the masters are bit for bit equal.
    config.train.max_grad_norm = None
    return config


def sixteen_bit_policy(tied: bool, dtype: torch.dtype) -> Policy:
    path = build_tiny_model("qwen2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
        model.config.tie_word_embeddings = True
    return Policy(model=model, tokenizer=AutoTokenizer.from_pretrained(path), model_dir=str(path), dtype=dtype)


def train(policy: Policy, optimizer, dtype: torch.dtype) -> list[tuple[float, float, float]]:
    """STEPS updates on the batch as driver/update/step.py makes them: a forward without gradients first (the
    old logprobs), the parameters listed, then optimizer_steps; each backward followed by another forward
    without gradients before the optimizer step. (old logprobs' loss, loss, grad_norm) of each update."""
    packed, settings = pack(PROMPTS, COMPLETIONS), config(dtype)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    measured = []

    def backward_pass() -> Metrics:
        logps, _, mask = completion_logprobs(policy.model, packed)
        loss = -(logps * mask).sum() / mask.sum()
        (loss * loss_scale(settings, optimizer)).backward()  # float16: the scale, as micro_batch_loss applies it
        with torch.no_grad():
            completion_logprobs(policy.model, packed)
        return Metrics({"loss": float(loss.detach())})

    for _ in range(STEPS):
        with torch.no_grad():
            old_logps, _, mask = completion_logprobs(policy.model, packed)
        update = optimizer_steps(settings, policy.trainable_parameters(), optimizer, scheduler, [backward_pass])
        measured.append((float(-(old_logps * mask).sum() / mask.sum()), update["loss"], update["grad_norm"]))
    return measured


def assert_same_updates(measured, measured_two) -> None:
    """train()'s (old logprobs' loss, loss, grad_norm) of each update, one process's and two ranks'."""
    for (old_loss, loss, grad_norm), (old_loss_two, loss_two, grad_norm_two) in zip(measured, measured_two,
                                                                                    strict=True):
        assert old_loss_two == pytest.approx(old_loss, rel=1e-5)  # after a step: with the weights it made
        assert loss_two == pytest.approx(loss, rel=1e-5)
        assert grad_norm_two == pytest.approx(grad_norm, rel=1e-5)  # fp32 norms of the same gradients


def rank_main(rank: int, port: int, tied: bool, dtype: torch.dtype, directory: Path, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from driver.distributed import world
    from driver.distributed.fsdp import full_model_state, reshard_before_steps, save_optimizer, shard_full_model

    torch.set_num_threads(1)
    world.init_world()
    try:
        policy = sixteen_bit_policy(tied, dtype)
        shard_full_model(policy.model, master_weights=True)
        shards = policy.trainable_parameters()
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in shards)
        optimizer = build_optimizer(shards, config(dtype).train, model=policy.model)
        assert not isinstance(optimizer, MasterWeightsOptimizer)  # the fp32 shards are the master weights
        reshard_before_steps(optimizer, policy.model)
        measured = train(policy, optimizer, dtype)
        state = full_model_state(policy.model)
        for name in ("first", "second"):  # what a run saves at every sync and checkpoint (rank 0 writes)
            policy.save_trained(directory / name)
        save_optimizer(directory / "checkpoint", policy.model, optimizer, with_weights=True)  # as a checkpoint does
        whole = {name: tensor.clone() for name, tensor in state.items()}
        results[rank] = (measured, whole, *resumed_on(tied, dtype, directory))
    finally:
        dist.destroy_process_group()


def resumed_on(tied: bool, dtype: torch.dtype, directory: Path) -> tuple[list, float | None, dict]:
    """One process's optimizer state resumed on this rank (driver/checkpoint.py under torchrun) into the untrained
    weights (the masters must replace them), then STEPS updates: what they measured, the loss scale after them and
    the whole weights (rank 0's)."""
    from driver.distributed.fsdp import (full_model_state, load_unsharded_optimizer, reshard_before_steps,
                                         shard_full_model)

    policy = sixteen_bit_policy(tied, dtype)
    shard_full_model(policy.model, master_weights=True)
    optimizer = build_optimizer(policy.trainable_parameters(), config(dtype).train, model=policy.model)
    reshard_before_steps(optimizer, policy.model)
    start_loss_scale(config(dtype), optimizer)  # as train.py primes it before a resume
    load_unsharded_optimizer(policy.model, optimizer, torch.load(directory / "one-process.pt"),
                             policy.trainable_parameters())
    measured = train(policy, optimizer, dtype)
    state = full_model_state(policy.model)
    return measured, optimizer.param_groups[0].get("loss_scale"), {name: t.clone() for name, t in state.items()}


@pytest.mark.parametrize(("tied", "dtype"), [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16)],
                         ids=["untied", "tied", "untied-float16"])
def test_two_ranks_train_the_fp32_masters_one_process_trains_and_checkpoints_cross_over(tied, dtype, tmp_path):
    torch.set_num_threads(1)
    policy = sixteen_bit_policy(tied, dtype)
    optimizer = build_optimizer(policy.trainable_parameters(), config(dtype).train, model=policy.model)
    assert isinstance(optimizer, MasterWeightsOptimizer)
    start_loss_scale(config(dtype), optimizer)
    measured = train(policy, optimizer, dtype)
    torch.save(optimizer.state_dict(), tmp_path / "one-process.pt")  # its checkpoint's (trainer_state.pt's)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(free_port(), tied, dtype, tmp_path, results), nprocs=2, join=True)
        results = dict(results)
    masters = dict(zip([name for name, _ in policy.model.named_parameters()], optimizer.masters, strict=True))

    (measured_0, gathered, *resumed_0), (measured_1, nothing, *resumed_1) = results[0], results[1]
    assert nothing == {} == resumed_1[2]  # the whole weights reach rank 0 only
    assert measured_0 == measured_1
    assert_same_updates(measured, measured_0)
    assert measured[-1][1] < measured[0][1] - 0.1  # it trains: a weight left behind would show
    for name, master in masters.items():
        assert gathered[name].dtype == torch.float32
        torch.testing.assert_close(gathered[name], master.detach(), rtol=0, atol=1e-6, msg=name)
    start = sixteen_bit_policy(tied, dtype).model.lm_head.weight.float()
    assert (gathered["lm_head.weight"] != start).float().mean() > 0.5
    if tied:  # one weight under two names, trained once
        assert torch.equal(gathered["lm_head.weight"], gathered["model.embed_tokens.weight"])
    # Saved as the model computes: in its 16-bit dtype, the masters rounded, and said so in config.json
    # (save_pretrained itself would write the dtype of the fp32 shards), at every save.
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "second")
    assert saved.config.dtype == dtype
    assert json.loads((tmp_path / "second" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    for name, weight in saved.state_dict().items():
        assert torch.equal(weight, gathered[name].to(dtype)), name

    # The two ranks' sharded checkpoint state resumed in one process (driver/checkpoint.py): its masters are the
    # fp32 shards, its AdamW state the one process's own, its 16-bit weights the masters rounded.
    resumed = sixteen_bit_policy(tied, dtype)
    fresh = build_optimizer(resumed.trainable_parameters(), config(dtype).train, model=resumed.model)
    with fresh.in_place_of_weights(resumed.model) as inner:
        load_optimizer(tmp_path / "checkpoint", resumed.model, inner, with_weights=True)
    names = [name for name, _ in resumed.model.named_parameters()]
    for name, master, expected, weight in zip(names, fresh.masters, optimizer.masters, resumed.trainable_parameters(),
                                              strict=True):
        assert torch.equal(master.detach(), gathered[name]), name
        assert weight.dtype == dtype and torch.equal(weight.detach(), master.detach().to(dtype)), name
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fresh.state[master][key], optimizer.state[expected][key], rtol=0, atol=1e-7)
        assert int(fresh.state[master]["step"]) == STEPS
    assert fresh.param_groups[1]["weight_decay"] == 0.0 and len(fresh.param_groups) == len(optimizer.param_groups)

    # The one process's state at STEPS resumed on two ranks (resumed_on): they train on as the one process does. A
    # lost master shows in the first loss, a lost AdamW moment or step count in the updates after it.
    measured_on, (measured_resumed, scale, gathered_resumed) = train(policy, optimizer, dtype), resumed_0
    assert measured_resumed == resumed_1[0]
    assert_same_updates(measured_on, measured_resumed)
    assert scale == optimizer.param_groups[0].get("loss_scale")  # float16's scale rides in the param groups
    for name, master in masters.items():
        torch.testing.assert_close(gathered_resumed[name], master.detach(), rtol=0, atol=1e-6, msg=name)

