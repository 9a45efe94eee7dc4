"""AdamW (torch's, fused or not, or bitsandbytes' 8-bit) over the adapter, the learning-rate schedule
(per optimizer update), and the optimizer loop every algorithm's update runs (GRPO:
driver/update/step.py, strided EBFT: driver/ebft/strided_update.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial

import torch

from driver.config import Config, TrainConfig
from driver.metrics.combine import Metrics, combine_metrics
from driver.update.loss_scale import loss_scale, scales_loss, unscale_gradients
from driver.update.master_weights import MasterWeightsOptimizer, gradient_holders, needs_master_weights


# transformers' Trainer decays no bias and no norm weight (get_decay_parameter_names): these names, and LayerNorms.
NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def build_optimizer(parameters: list[torch.nn.Parameter], config: TrainConfig,
                    model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """train.optim's AdamW over the trainable parameters (the adapter; every weight under full fine-tuning, whose
    16-bit weights it steps as fp32 master weights unless train.master_weights is off). model: the parameters'
    module, whose biases and norm weights then take no weight decay, as in TRL (an adapter has neither)."""
    if not parameters:
        raise ValueError("the model has no trainable parameters: check lora.targets against the model's module names")
    exempt = undecayed(model, parameters) if model is not None and config.weight_decay else set()
    if config.master_weights and needs_master_weights(parameters):
        return MasterWeightsOptimizer(parameters, partial(adamw, config=config, exempt=exempt))
    return adamw(parameters, config, exempt)


def undecayed(model: torch.nn.Module, parameters: list[torch.nn.Parameter]) -> set[int]:
    """Positions in `parameters` of the biases and norm weights of `model` (transformers' rule)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    layernorms = {id(parameter) for module in model.modules() if isinstance(module, torch.nn.LayerNorm)
                  for parameter in module.parameters(recurse=False)}
    return {index for index, parameter in enumerate(parameters)
            if id(parameter) in layernorms or NO_DECAY_NAMES.search(names.get(id(parameter), "").lower())}


def adamw(parameters: list[torch.Tensor], config: TrainConfig, exempt: set[int] = frozenset()) -> torch.optim.Optimizer:
    """exempt: positions in `parameters` that take no weight decay (a second param group, after the first)."""
    adam = {"lr": config.lr, "weight_decay": config.weight_decay, "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_epsilon}
    decayed = [p for i, p in enumerate(parameters) if i not in exempt]
    groups = [{"params": decayed}] if decayed else []
    if exempt:
        groups.append({"params": [p for i, p in enumerate(parameters) if i in exempt], "weight_decay": 0.0})
    if config.optim in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes  # TrainConfig checked that it is installed

        optimizer = bitsandbytes.optim.PagedAdamW8bit if config.optim == "paged_adamw_8bit" else \
            bitsandbytes.optim.AdamW8bit
        return optimizer(groups, **adam)
    return torch.optim.AdamW(groups, **adam, fused=True if config.optim == "adamw_torch_fused" else None)


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_updates: int):
    # transformers' get_warmup_steps: warmup_steps when given, else the ratio of the run, rounded up
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_updates)

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / (warmup + 1)
        progress = (update - warmup) / max(1, total_updates - warmup)
        if config.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if config.schedule == "cosine":  # down to min_lr_rate x lr, as transformers' cosine_with_min_lr
            cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
            return config.min_lr_rate + (1.0 - config.min_lr_rate) * cosine
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_steps(config: Config, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler,
                    backward_passes: list[Callable[[], Metrics] | None],
                    after_update: Callable[[int], None] | None = None) -> Metrics:
    """algo.num_iterations rounds of one optimizer update per backward pass (steps_per_generation
    parts of a generated batch, or one): zero the gradients, run the pass (the backward of every
    micro-batch; returns that update's metrics), clip to train.max_grad_norm, step the optimizer and
    the schedule. A None pass (a part without rows) steps the schedule only. In float16 the gradients are unscaled
    first, and an update that overflowed steps neither (driver/update/loss_scale.py). after_update gets the
    schedule's count of updates after each one. Returns the updates' metrics combined, with grad_norm (and in
    float16 loss_scale and skipped_update_fraction)."""
    updates = []
    for _ in range(config.algo.num_iterations):
        for backward_pass in backward_passes:
            if backward_pass is None:
                scheduler.step()
                continue
            optimizer.zero_grad(set_to_none=True)
            metrics = backward_pass()
            updates.append(metrics)
            holders = gradient_holders(optimizer, params)  # fp32 master weights hold the gradients: clipped there
            stepped = unscale_gradients(config, optimizer, holders)
            if scales_loss(config):
                metrics.values["skipped_update_fraction"] = 0.0 if stepped else 1.0
            if not stepped:  # float16 overflowed: no step, as GradScaler; no grad_norm to average in
                continue
            grad_norm = torch.nn.utils.clip_grad_norm_(holders, config.train.max_grad_norm or math.inf)
            metrics.values["grad_norm"] = float(grad_norm)
            optimizer.step()
            scheduler.step()
            if after_update is not None:
                after_update(scheduler.last_epoch)
    combined = combine_metrics(updates)
    if scales_loss(config) and updates:
        combined.values["loss_scale"] = loss_scale(config, optimizer)  # for the next step's updates
    return combined
