"""Built-in toy datasets and their rewards, small enough for a tiny random model to learn on CPU.

`toy:digits`: prompts ask for digits; the reward is the fraction of the completion's visible
characters that are digits. A random model starts near 10/384 per token and GRPO can push the
whole output distribution towards the ten digit tokens within a few dozen steps, so "the reward
went up" is a sharp end-to-end check of the loop (generation, rewards, advantages, loss, sync).

`toy:digits-chat`: the same prompts as conversations (system + user message, rendered with the chat
template); completions then reach the reward functions as [{"role": "assistant", "content": ...}].

`toy:digits-gt`: the same prompts, each with a `ground_truth` of digit groups (for algo.name = ebft,
which matches the features of the completions to those of the ground truth instead of scoring a
reward): a tiny model fits it by learning to write digits, so the feature-matching loss falls.

`toy:add-tools`: tool-calling episodes (environment.name: tools with driver.environments.toy.add):
"What is a + b?" as a chat prompt, with the operands and the answer as columns for
driver.environments.toy.sum_reward.

`toy:digits-conversations`: EBFT chat data, a `messages` column of three user turns, each answered with
digit groups (driver.ebft.transforms.first_turn makes the first answer the ground truth and keeps the
other two as `remaining_turns`, which multi-turn EBFT rolls out).

Reward functions follow TRL's signature: fn(prompts, completions, **columns) -> list[float | None];
a completion is text, or a conversation (TRL's conversational format) whose last message is scored.
"""

from __future__ import annotations

import random

from driver.data.conversation import completion_text

WORDS = ("apple river stone cloud green seven light house music paper table window garden "
         "number letter quiet silver orange simple little water dream train").split()
TASKS = {"digits": "Write digits:"}  # the tiny tokenizer's corpus reads this: changing it changes the tokenizer
GROUND_TRUTH_TASKS = {"digits-gt": "digits"}  # toy set with a ground_truth column -> the task of its prompts
CHAT_TASKS = {"digits-chat": "digits"}  # toy set of conversations (a system and a user message) -> its task
CONVERSATION_TASKS = {"digits-conversations": "digits"}  # toy set of whole conversations (`messages`)
FOLLOW_UPS = ("More digits.", "Again.")  # the later user turns of toy:digits-conversations
SYSTEM_MESSAGE = "Answer with digits only."


def toy_dataset(name: str, size: int = 256, seed: int = 0) -> list[dict]:
    if name == "add-tools":
        return add_tool_rows(size, seed)
    task = {**GROUND_TRUTH_TASKS, **CHAT_TASKS, **CONVERSATION_TASKS}.get(name, name)
    if task not in TASKS:
        raise ValueError(f"unknown toy dataset 'toy:{name}'; choose one of "
                         + ", ".join(f"toy:{n}" for n in [*TASKS, *GROUND_TRUTH_TASKS, *CHAT_TASKS,
                                                           *CONVERSATION_TASKS, "add-tools"]))
    rng = random.Random(seed)
    rows = []
    for index in range(size):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        rows.append({"prompt": f"{TASKS[task]} {words}", "id": index})
    if name in GROUND_TRUTH_TASKS:
        for row in rows:  # drawn after the prompts, so toy:digits and toy:digits-gt share their prompts
            row["ground_truth"] = digit_groups(rng)
    if name in CHAT_TASKS:  # TRL's conversational format: the reward functions get message lists
        for row in rows:
            row["prompt"] = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": row["prompt"]}]
    if name in CONVERSATION_TASKS:
        for row in rows:
            users = [row.pop("prompt"), *FOLLOW_UPS]
            row["messages"] = [message for user in users for message in (
                {"role": "user", "content": user}, {"role": "assistant", "content": digit_groups(rng)})]
    return rows


def add_tool_rows(size: int, seed: int) -> list[dict]:
    rng = random.Random(f"{seed}:add-tools")
    rows = []
    for index in range(size):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = f"What is {a} + {b}? Call add, then answer with the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "a": a, "b": b, "answer": str(a + b),
                     "id": index})
    return rows


def digit_groups(rng: random.Random) -> str:
    return " " + " ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(2, 3)))


def digit_fraction(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """Fraction of non-space characters that are ASCII digits; an empty answer has none: 0. (None
    would mean "not applicable", which leaves a completion without a learning signal.)"""
    rewards = []
    for completion in map(completion_text, completions):
        visible = [c for c in completion if not c.isspace()]
        rewards.append(sum(c.isdigit() for c in visible) / len(visible) if visible else 0.0)
    return rewards


def corpus() -> list[str]:
    """Text the tiny models' tokenizer is trained on (fixed: same tokenizer every build)."""
    rng = random.Random(42)
    lines = [f"{prompt} {rng.randint(0, 10**6)}" for prompt in TASKS.values() for _ in range(50)]
    lines += [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(300)]
    lines += ["The quick brown fox jumps over the lazy dog. 0123456789 " * 3,
              "Question: what is 12 + 30? Answer: 42. #### 42"]
    return lines


def digit_fraction_steps(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """digit_fraction rounded down to quarters: a coarse reward under which whole groups often score
    the same (all 0 early, all 1 late), to exercise zero-advantage filtering, replay and re-rolls."""
    return [int(value * 4) / 4 for value in digit_fraction(prompts, completions, **columns)]
