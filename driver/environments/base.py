"""The environment interface: what an episode's other side does after each model turn.

An Environment is made once per episode (a factory, `make_factory`), reset from the episode's data row,
then stepped on each model turn: it answers with messages (tool results, a user turn), which the
driver renders with the chat template and appends to the sample as tokens that carry no loss, or it
ends the episode, optionally with a reward (driver.environments.environment_reward passes it to the
reward table). TRL's environments and tools, verl's agent loops and NeMo Gym's agents have this shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ModelTurn:
    text: str  # the turn decoded without special tokens (what a user would read)
    raw_text: str  # decoded with special tokens (what tool-call parsers read: <tool_call> may be one)
    token_ids: list[int]
    finish_reason: str  # "stop": the model ended its turn; "length": the episode's token budget ran out


@dataclass
class StepResult:
    messages: list[dict]  # the environment's answer (tool results, a user turn); [] when done
    done: bool  # the episode is over (the model's last turn was its answer)
    reward: float | None = None  # the episode's reward, when the environment gives one (done)
    # The model turn as a chat message, e.g. with its parsed tool_calls (None: {"role": "assistant", "content": text})
    assistant: dict | None = None
    tool_calls: int = 0
    tool_failures: int = 0  # calls that raised or named no known tool
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    tools: list[dict]  # JSON schemas of the tools it offers, rendered into the prompt ([]: none)

    def reset(self, row: dict) -> None:
        """Start an episode on this data row (every column of it)."""

    def step(self, turn: ModelTurn) -> StepResult:
        """The model's turn: answer it, or end the episode."""


EnvironmentFactory = Callable[[], Environment]


def assistant_message(turn: ModelTurn) -> dict:
    return {"role": "assistant", "content": turn.text}
