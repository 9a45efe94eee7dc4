"""TRL's conversational format: a prompt given as chat messages makes every completion a message list
too, [{"role": "assistant", "content": text}], and reward functions receive both as lists."""

from __future__ import annotations


def as_assistant_message(text: str) -> list[dict]:
    """A completion in the conversational format."""
    return [{"role": "assistant", "content": text}]


def completion_text(completion: str | list[dict]) -> str:
    """The text a reward scores: the completion itself, or a conversation's last message's content."""
    if isinstance(completion, str):
        return completion
    if not completion or not isinstance(completion[-1], dict) or "content" not in completion[-1]:
        raise ValueError(f"a completion must be text or a list of {{'role', 'content'}} messages, got {completion!r}")
    return str(completion[-1]["content"])
