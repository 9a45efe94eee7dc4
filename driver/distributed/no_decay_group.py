"""Optimizer state written before biases and norm weights took no weight decay (driver/update/optim.py's second
param group, full fine-tuning with train.weight_decay > 0) has one param group where this run's optimizer has two:
the decayed weights, then the exempt ones. torch refuses such a state ("a different number of parameter groups")
and torch.distributed.checkpoint misses the second group's keys, so those checkpoints would not resume. Split
here: both groups take the saved group's settings (the learning rate the schedule reached, the betas), the second
with no decay, and every weight keeps its own AdamW moments and step count."""

from __future__ import annotations

import torch


def predates_no_decay_group(saved_groups: int, groups: list[dict]) -> bool:
    """Whether a saved optimizer state of `saved_groups` param groups is one written before these two groups."""
    return saved_groups == 1 and len(groups) == 2 and groups[1]["weight_decay"] == 0.0


def split_saved_group(saved: dict, optimizer: torch.optim.Optimizer, parameters: list[torch.Tensor]) -> dict:
    """A one-process checkpoint's optimizer state (torch's state_dict, keyed by position in its param groups; or
    MasterWeightsOptimizer's {"inner": that, "masters": ...}) in the param groups of `optimizer`, built over
    `parameters`. A state of one group lists them in the order of `parameters`. Any other state as it is."""
    inner = saved.get("inner", saved)
    if not predates_no_decay_group(len(inner["param_groups"]), optimizer.param_groups):
        return saved
    # The tensors the optimizer steps: the parameters, or their fp32 masters in the same order.
    position = {id(tensor): index for index, tensor in enumerate(getattr(optimizer, "masters", parameters))}
    order = [position[id(tensor)] for group in optimizer.param_groups for tensor in group["params"]]
    (saved_group,), (_, exempt) = inner["param_groups"], optimizer.param_groups
    decayed = len(order) - len(exempt["params"])
    groups = [{**saved_group, "params": list(range(decayed))},
              {**saved_group, "weight_decay": exempt["weight_decay"], "params": list(range(decayed, len(order)))}]
    split = {"state": {new: inner["state"][old] for new, old in enumerate(order) if old in inner["state"]},
             "param_groups": groups}
    return {**saved, "inner": split} if "inner" in saved else split


def merged_groups(groups: list[dict]) -> list[dict]:
    """torch.distributed.checkpoint's param groups (parameter names) as one group, the shape an old checkpoint holds,
    to load it into."""
    return [{**groups[0], "params": [name for group in groups for name in group["params"]]}]


def split_loaded_group(loaded: list[dict], groups: list[dict]) -> list[dict]:
    """The one group loaded into merged_groups(groups), back in `groups`' two (the second's weight decay, 0)."""
    (group,) = loaded
    return [{**group, "params": groups[0]["params"]},
            {**group, "weight_decay": groups[1]["weight_decay"], "params": groups[1]["params"]}]
