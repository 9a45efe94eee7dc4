"""The tool and the reward of the toy tool-calling task (toy:add-tools, examples/tiny-tools-grpo.yaml),
small enough for the tiny random model: call add(a, b), read its result, answer with the number."""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def sum_reward(completions: list, a: list[int], b: list[int], answer: list[str], **columns) -> list[float]:
    """Per episode, shaped so a random model gets signal: 0.5 for calling add, 0.25 for each operand it
    passed right (its best call), and 1.0 when the last model turn is the right sum."""
    rewards = []
    for episode, first, second, expected in zip(completions, a, b, answer):
        turns = ([message for message in episode if message.get("role") == "assistant"]
                 if isinstance(episode, list) else [{"content": str(episode)}])
        calls = [call["function"] for turn in turns for call in turn.get("tool_calls") or []
                 if call.get("function", {}).get("name") == "add"]
        operands = max((0.25 * (call.get("arguments", {}).get("a") == first)
                        + 0.25 * (call.get("arguments", {}).get("b") == second)
                        for call in calls if isinstance(call.get("arguments"), dict)), default=0.0)
        answered = bool(turns) and str(turns[-1].get("content") or "").strip() == expected
        rewards.append(0.5 * bool(calls) + operands + 1.0 * answered)
    return rewards
