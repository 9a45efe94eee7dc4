"""What TRL passes its reward functions as `trainer_state` (transformers' TrainerState), with the fields
rewards read to depend on training progress (a length penalty that tightens, a curriculum): a reward written
for TRL that reads trainer_state.global_step runs here unchanged. Torch-free: reward workers unpickle it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerState:
    global_step: int = 0  # optimizer updates done before the one this completion is trained in (TRL's)
    max_steps: int = 0  # optimizer updates in the run (train.steps x num_iterations x steps_per_generation)
    epoch: float = 0.0  # passes over the prompts when the completion's group finished (fractional)
