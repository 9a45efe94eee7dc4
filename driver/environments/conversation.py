"""The multi-turn conversation environment: the data's later user turns follow the model's answers.

Each row holds its later user messages in a column (environment.user_turns_field, a list of strings):
after each model turn the next one is said, and the episode ends after the model answers the last.
"""

from __future__ import annotations

from driver.environments.base import ModelTurn, StepResult, assistant_message


class ConversationEnvironment:
    tools: list[dict] = []

    def __init__(self, user_turns_field: str) -> None:
        self.field = user_turns_field
        self.pending: list[str] = []

    def reset(self, row: dict) -> None:
        turns = row.get(self.field)
        if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
            got = type(turns).__name__ if turns is not None else "no such column"
            raise ValueError(f"environment conversation: the row's '{self.field}' column must be a list of user "
                             f"messages (strings), got {got}; columns are {sorted(row)}")
        self.pending = list(turns)

    def step(self, turn: ModelTurn) -> StepResult:
        if not self.pending:
            return StepResult([], done=True, assistant=assistant_message(turn))
        return StepResult([{"role": "user", "content": self.pending.pop(0)}], done=False,
                          assistant=assistant_message(turn))
