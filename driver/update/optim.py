"""AdamW over the adapter and the learning-rate schedule (per optimizer update)."""

from __future__ import annotations

import math

import torch

from driver.config import TrainConfig


def build_optimizer(parameters: list[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    if not parameters:
        raise ValueError("the model has no trainable parameters: check lora.targets against the model's module names")
    return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, total_updates: int):
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / (warmup + 1)
        progress = (update - warmup) / max(1, total_updates - warmup)
        if config.schedule == "linear":
            return max(0.0, 1.0 - progress)
        if config.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
