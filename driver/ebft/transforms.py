"""`data.transform`s that turn chat rows into EBFT's (prompt, ground_truth) rows.

Input rows hold a `messages` column: OpenAI-style turns {"role": "system" | "user" | "assistant",
"content": str}. Output rows hold `prompt` = the messages before one assistant turn (a conversation
ending with a user turn, rendered by data.py with the chat template) and `ground_truth` = that turn's
content, which the policy's completions are feature-matched against. `messages` is consumed; every
other column is kept (an existing `prompt` / `ground_truth` column is replaced, by first_turn also
`remaining_turns`).

first_turn also keeps the messages after that turn as `remaining_turns`, alternating user and
assistant turns: EBFT structured mode generates each later assistant turn after the data's user turns
and matches the whole generated conversation against the data's (driver/ebft/multi_turn.py); only the
first turn is trained. A row with no later turns has `remaining_turns: []` and trains as a single turn.

Follows axolotl's ebft_chat_multiturn.py (transform / transform_last_turn / transform_all_turns) and
ebft_reasoning.py (answer-only ground truth). Use as e.g. `data.transform:
driver.ebft.transforms.all_turns`; a bad row raises ValueError.
"""

from __future__ import annotations

import re

MESSAGES_FIELD = "messages"
REMAINING_TURNS_FIELD = "remaining_turns"  # first_turn's later turns (axolotl's column name)
ROLES = ("system", "user", "assistant")
# A reasoning block and the whitespace after it (axolotl ebft_reasoning._strip_thinking); unpaired
# tags are left as they are.
THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", flags=re.DOTALL)


def first_turn(row: dict) -> dict:
    """Ground truth = the first assistant turn; prompt = everything before it; remaining_turns = the
    messages after it (axolotl's ebft_chat_multiturn.transform), which must alternate user, assistant,
    user, ... A final user turn without an answer is dropped: no assistant turn of the data follows it to
    compare a generated one with, and it would only add the same tokens to both sides of the features."""
    messages = _conversation(row)
    first = _assistant_turns(row, messages)[0]
    later = messages[first + 1:]
    if later and later[-1]["role"] == "user":
        later = later[:-1]
    check_later_turns(later, MESSAGES_FIELD, start=first + 1)
    return {**_row_for_turn(row, messages, first), REMAINING_TURNS_FIELD: [dict(message) for message in later]}


def last_turn(row: dict) -> dict:
    """Ground truth = the last assistant turn; prompt = the whole history before it."""
    messages = _conversation(row)
    return _row_for_turn(row, messages, _assistant_turns(row, messages)[-1])


def all_turns(row: dict) -> list[dict]:
    """One row per assistant turn, in order, each with the history before that turn as its prompt
    (data.load_rows explodes a returned list into several rows)."""
    messages = _conversation(row)
    return [_row_for_turn(row, messages, turn) for turn in _assistant_turns(row, messages)]


def strip_thinking(row: dict) -> dict:
    """Removes <think>...</think> blocks from `ground_truth`, so features match the answer only
    (reasoning chains may differ while the answer should not). The prompt is left as it is."""
    ground_truth = row.get("ground_truth")
    if not isinstance(ground_truth, str):
        raise ValueError(f"strip_thinking needs a str 'ground_truth' column (apply a turn transform first); "
                         f"columns are {sorted(row)}")
    return {**row, "ground_truth": THINK_BLOCK.sub("", ground_truth).strip()}


def last_turn_answer_only(row: dict) -> dict:
    """last_turn, then strip_thinking: axolotl's ebft_reasoning.transform_answer_only."""
    return strip_thinking(last_turn(row))


def check_later_turns(turns, name: str = REMAINING_TURNS_FIELD, start: int = 0) -> None:
    """Raises ValueError unless `turns` is a list of {"role", "content": str} messages alternating user,
    assistant, user, ..., ending with an assistant turn (pairs of a user turn and the data's answer).
    Errors name the message as `name[start + i]`."""
    if not isinstance(turns, list):
        raise ValueError(f"{name} must be a list of chat messages, got {type(turns).__name__}")
    for offset, message in enumerate(turns):
        expected, article = ("user", "a") if offset % 2 == 0 else ("assistant", "an")
        if not (isinstance(message, dict) and message.get("role") == expected
                and isinstance(message.get("content"), str)):
            shown = repr(message)
            raise ValueError(f"{name}[{start + offset}] must be {article} {expected} turn {{'role': '{expected}', "
                             f"'content': str}} (the turns after the first assistant turn alternate user, "
                             f"assistant), got {shown[:200] + ('...' if len(shown) > 200 else '')}")
    if len(turns) % 2:
        raise ValueError(f"{name} must end with an assistant turn (the data's answer to the last user turn), "
                         f"got a user turn at {name}[{start + len(turns) - 1}]")


def _conversation(row: dict) -> list[dict]:
    """The row's messages, checked: a non-empty list of {"role", "content"} dicts of known roles."""
    messages = row.get(MESSAGES_FIELD)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"row needs a non-empty list of chat messages in '{MESSAGES_FIELD}', got "
                         f"{type(messages).__name__ if messages is not None else 'no such column'}; "
                         f"columns are {sorted(row)}")
    for index, message in enumerate(messages):
        if not (isinstance(message, dict) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            shown = repr(message)
            raise ValueError(f"{MESSAGES_FIELD}[{index}] must be a dict with 'role' in {'/'.join(ROLES)} and a str "
                             f"'content', got {shown[:200] + ('...' if len(shown) > 200 else '')}")
    return messages


def _assistant_turns(row: dict, messages: list[dict]) -> list[int]:
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if not turns:
        raise ValueError(f"row has no assistant turn to use as ground truth (roles: "
                         f"{', '.join(m['role'] for m in messages)}); columns are {sorted(row)}")
    return turns


def _row_for_turn(row: dict, messages: list[dict], turn: int) -> dict:
    # The prompt must end with a user turn: the policy generates where the data's assistant answered,
    # and the chat template's generation prompt after anything else would be a different task.
    if turn == 0 or messages[turn - 1]["role"] != "user":
        before = messages[turn - 1]["role"] if turn else "nothing"
        raise ValueError(f"{MESSAGES_FIELD}[{turn}] is an assistant turn after {before}, not after a user turn")
    # Copies of the messages: rows exploded from one conversation must not share mutable dicts.
    kept = {key: value for key, value in row.items() if key != MESSAGES_FIELD}
    return {**kept, "prompt": [dict(message) for message in messages[:turn]],
            "ground_truth": messages[turn]["content"]}
