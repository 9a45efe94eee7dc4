"""Reward functions and data transforms for common tasks (referenced from examples/*.yaml).

All follow TRL's reward signature: fn(prompts, completions, **columns) -> list[float | None].
"""

from __future__ import annotations

import re

from driver.data.conversation import completion_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")
_ANSWER_MARK = re.compile(r"####\s*(.+)")


def normalize_number(text: str) -> str | None:
    match = _NUMBER.search(text.replace("$", ""))
    if match is None:
        return None
    value = match.group(0).replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def extract_answer(completion: str) -> str | None:
    """The final answer: \\boxed{...}, else after '####', else the last number in the text."""
    for pattern in (_BOXED, _ANSWER_MARK):
        found = pattern.findall(completion)
        if found:
            return normalize_number(found[-1])
    numbers = _NUMBER.findall(completion)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_correct(prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
    """1.0 when the completion's final number equals the reference answer (GSM8K's '#### 42')."""
    rewards = []
    for completion, reference in zip(map(completion_text, completions), answer):
        expected = extract_answer(str(reference))
        rewards.append(float(expected is not None and extract_answer(completion) == expected))
    return rewards


def boxed_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1.0 when the completion gives its answer in \\boxed{...} (a small shaping reward)."""
    return [float(bool(_BOXED.search(c))) for c in map(completion_text, completions)]


def gsm8k_prompt(example: dict) -> dict:
    """GSM8K row {question, answer} -> adds the prompt asked of the model."""
    return {**example, "prompt": f"{example['question']}\nReason step by step, then give the final answer as "
                                 "\\boxed{number}."}
