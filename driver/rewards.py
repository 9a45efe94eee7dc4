"""Reward functions named in the config, called once per rollout batch (TRL's signature:
fn(prompts, completions, **columns) -> list[float | None]); None becomes NaN and is left out of
the statistics downstream."""

from __future__ import annotations

import math

import torch

from driver.cli import import_dotted
from driver.config import RewardsConfig


class RewardError(RuntimeError):
    pass


class RewardFunctions:
    def __init__(self, config: RewardsConfig) -> None:
        self.functions = [import_dotted(f.path, f"rewards.functions[{i}].path")
                          for i, f in enumerate(config.functions)]
        self.names = [f.name or fn.__name__ for f, fn in zip(config.functions, self.functions)]
        self.weights = torch.tensor([f.weight for f in config.functions], dtype=torch.float32)

    def __call__(self, prompts: list[str], completions: list[str], columns: list[dict],
                 completion_ids: list[list[int]]) -> torch.Tensor:
        """[N, F] float32 rewards, NaN where a function returned None."""
        keyword_columns = {key: [row.get(key) for row in columns] for key in columns[0]} if columns else {}
        keyword_columns.pop("prompt", None)
        table = torch.empty(len(completions), len(self.functions), dtype=torch.float32)
        for column, (name, function) in enumerate(zip(self.names, self.functions)):
            values = function(prompts=prompts, completions=completions, completion_ids=completion_ids,
                              **keyword_columns)
            if not isinstance(values, (list, tuple)) or len(values) != len(completions):
                raise RewardError(f"reward '{name}' returned {type(values).__name__} of length "
                                  f"{len(values) if hasattr(values, '__len__') else '?'} for {len(completions)} completions")
            for row, value in enumerate(values):
                if value is None:
                    table[row, column] = math.nan
                elif isinstance(value, (int, float)) and not isinstance(value, bool) or hasattr(value, "item"):
                    table[row, column] = float(value)
                else:
                    raise RewardError(f"reward '{name}' returned {value!r} for completion {row} "
                                      f"({completions[row][:80]!r}); expected a number or None")
        return table
