"""Reward functions named in the config, called once per rollout batch (TRL's signature:
fn(prompts, completions, completion_ids, **columns) -> list[float | None]); None becomes NaN and is
left out of the statistics downstream. A completion for which every function returned None has no
reward (NaN) and advantage 0 (driver/rewards/advantages.py); warn_unscorable says so once per step, as TRL.

The keyword arguments of a call (`reward_kwargs`, `group_call`) and the checks on what a function
returns (`reward_table`) are shared with the reward worker pool (driver/rewards/pool.py), so a reward
sees the same arguments and fails with the same message in a worker as in this process."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from driver.cli import reward_function
from driver.config import RewardsConfig
from driver.data.conversation import as_assistant_message, completion_text
from driver.rewards.calling import RewardCallFailed, call_rewards
from driver.rewards.reward_model import SequenceClassifierReward

if TYPE_CHECKING:
    from driver.data.records import Group


logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    pass


class RewardFunction(Protocol):
    """What `rewards.functions[i].path` names: TRL's reward-function signature. Every dataset column
    but the prompt comes as a keyword list, one entry per completion; None means "cannot score"."""

    def __call__(self, prompts: list[str] | list[list[dict]], completions: list[str] | list[list[dict]],
                 completion_ids: list[list[int]], **columns: list) -> list[float | None]: ...


def reward_kwargs(prompts: list[str], completions: list[str], columns: list[dict],
                  completion_ids: list[list[int]]) -> dict:
    """The keyword arguments of one call: every dataset column as a list, one entry per completion
    ("prompt" is left out: `prompts` already carries the prompt text)."""
    keyword_columns = {key: [row.get(key) for row in columns] for key in columns[0]} if columns else {}
    keyword_columns.pop("prompt", None)
    return {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **keyword_columns}


def group_call(group: Group, texts: list[str]) -> dict:
    """The keyword arguments scoring one group: its G completions (decoded `texts`) under one prompt. A
    conversation's prompt and completions go as message lists (TRL's conversational format)."""
    if len(texts) != len(group.samples):
        raise ValueError(f"group {group.group_id}: {len(texts)} texts for {len(group.samples)} samples")
    size = len(texts)
    messages = group.prompt.messages
    prompts = [group.prompt.text] * size if messages is None else [list(messages) for _ in range(size)]
    completions = list(texts) if messages is None else [as_assistant_message(text) for text in texts]
    kwargs = reward_kwargs(prompts, completions, [group.prompt.columns] * size,
                           [list(sample.token_ids) for sample in group.samples])
    kwargs["trainer_state"] = group.trainer_state  # TRL's: training progress, for rewards that follow it
    if any(sample.episode is not None for sample in group.samples):
        # Multi-turn episodes (driver/environments): the completion is the episode's messages after the
        # prompt (model turns with their tool calls, tool results, user turns), as TRL passes them, and the
        # environment's own reward goes along for driver.environments.rewards.environment_reward.
        kwargs["completions"] = [list(sample.episode.messages) if sample.episode is not None else completion
                                 for sample, completion in zip(group.samples, completions)]
        kwargs["environment_reward"] = [sample.episode.reward if sample.episode is not None else None
                                        for sample in group.samples]
    return kwargs


def reward_column(name: str, values, completions: list[str]) -> list[float]:
    """One function's return value as N floats (NaN for None); RewardError naming the function otherwise."""
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        raise RewardError(f"reward '{name}' returned {type(values).__name__} of length "
                          f"{len(values) if hasattr(values, '__len__') else '?'} for {len(completions)} completions")
    column = []
    for row, value in enumerate(values):
        if value is None:
            column.append(math.nan)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) or hasattr(value, "item"):
            column.append(float(value))
        else:
            raise RewardError(f"reward '{name}' returned {value!r} for completion {row} "
                              f"({completion_text(completions[row])[:80]!r}); expected a number or None")
    return column


def reward_table(names: list[str], values_per_function: Iterable, completions: list[str]) -> torch.Tensor:
    """[N, F] float32 from each function's return value, checked in function order (a lazy iterable
    is checked before the next function runs)."""
    table = torch.empty(len(completions), len(names), dtype=torch.float32)
    for column, (name, values) in enumerate(zip(names, values_per_function)):
        table[:, column] = torch.tensor(reward_column(name, values, completions), dtype=torch.float32)
    return table


class RewardFunctions:
    def __init__(self, config: RewardsConfig, device: str = "auto") -> None:
        """device: where reward models score (the trainer's model.device)."""
        # What a worker process needs to make the same functions (reward models score in this process).
        self.specs = [(f.path, f.kwargs) for f in config.functions]
        self.functions: list[RewardFunction] = [
            reward_function(f.path, f.kwargs, f"rewards.functions[{i}].path") if f.path is not None
            else SequenceClassifierReward(f.model, device, f.batch_size) for i, f in enumerate(config.functions)]
        self.names = [f.name or fn.__name__ for f, fn in zip(config.functions, self.functions)]
        self.weights = torch.tensor([f.weight for f in config.functions], dtype=torch.float32)

    def __call__(self, prompts: list[str], completions: list[str], columns: list[dict],
                 completion_ids: list[list[int]]) -> torch.Tensor:
        """[N, F] float32 rewards, NaN where a function returned None."""
        kwargs = reward_kwargs(prompts, completions, columns, completion_ids)
        try:
            values = call_rewards(self.functions, kwargs)
        except RewardCallFailed as failure:
            raise RewardError(f"reward '{self.names[failure.index]}' raised an exception\n{failure.trace}") from None
        return reward_table(self.names, values, completions)


def warn_unscorable(groups: list[Group]) -> int:
    """TRL's warning when every reward function returned None for a completion, once per call: the first
    such completion with its prompt and columns. Call it once per step, on the step's scored groups
    (batch assembly). Returns how many such completions the groups hold (0: no warning)."""
    unscorable = [(group, row) for group in groups for row in
                  group.rewards.isnan().all(dim=1).nonzero().flatten().tolist()]
    if unscorable:
        group, row = unscorable[0]
        row_kwargs = {**group.prompt.columns, "prompt": group.prompt.text,
                      "completion": group.texts[row] if group.texts is not None else None}
        logger.warning("All reward functions returned None for the following kwargs:\n%s\n"
                       "Please ensure that at least one reward function returns a valid reward. (%d such "
                       "completion(s) this step: their advantage is 0.)", row_kwargs, len(unscorable))
    return len(unscorable)
