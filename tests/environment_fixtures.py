"""Shared by the environment tests: tools the model may call, a stateful environment, and a scripted engine.

ScriptedEngine is a fake Generator (no model): it decodes each request (prompt + episode so far), asks
`script(conversation text, sample index)` for the next model turn, and returns its tokens followed by the
tokenizer's EOS, cut at the request's max_tokens ("length") as vLLM would. The tests read what the
episodes hold against renderings written by hand, not by the code under test.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from driver.engine.base import Completion
from driver.environments.base import ModelTurn, StepResult


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def fail(reason: str) -> str:
    """Always raises.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


def tool_call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class CountingEnvironment:
    """Answers every turn with "turn <k>" and ends after `turns` model turns with reward k; remembers what it
    was told (a stateful environment, for the resume test)."""

    tools: list[dict] = []

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.heard = turns, []

    def reset(self, row: dict) -> None:
        self.heard = []

    def step(self, turn: ModelTurn) -> StepResult:
        self.heard.append(turn.text)
        if len(self.heard) >= self.turns:
            return StepResult([], done=True, reward=float(len(self.heard)))
        return StepResult([{"role": "user", "content": f"turn {len(self.heard)}"}], done=False)


class ScriptedEngine:
    def __init__(self, tokenizer, script: Callable[[str, int], str]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.calls: list[list] = []  # the requests of each stream call
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids

    def stream(self, requests, version):
        """A request ending inside a turn (a partial rollout's continuation) gets the rest of that turn: the
        script sees the conversation up to the turn's start (its last assistant header)."""
        self.calls.append(list(requests))
        for index, request in enumerate(requests):
            start = self._turn_start(request.token_ids)
            text = self.tokenizer.decode(request.token_ids[:start], skip_special_tokens=False)
            done = request.token_ids[start:]
            completions = []
            for sample in range(request.n):
                target = (self.tokenizer(self.script(text, sample), add_special_tokens=False).input_ids
                          + [self.tokenizer.eos_token_id])
                assert target[: len(done)] == done, "a continuation must extend its script's turn"
                target = target[len(done):]
                tokens = target[: request.max_tokens]
                completions.append(Completion(tokens, [-0.25] * len(tokens),
                                              "stop" if len(tokens) == len(target) else "length"))
            yield index, completions

    def _turn_start(self, token_ids: list[int]) -> int:
        width = len(self.header)
        for end in range(len(token_ids), width - 1, -1):
            if token_ids[end - width:end] == self.header:
                return end
        return len(token_ids)
