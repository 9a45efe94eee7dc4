"""An axolotl GRPO recipe's Python side, in axolotl's interfaces, run by this driver unchanged:
examples/qwen2.5-1.5b-gsm8k-axolotl-recipe.yaml names these functions by dotted path.

- `prompt_transform(cfg, *args, **kwargs)` -> (map_fn, {"remove_columns": [...]}): axolotl's dataset
  transform signature (the driver merges map_fn's dict into each row, as datasets.map, then drops the
  listed columns);
- rewards read `completion[0]["content"]`: the prompt is a conversation, so completions arrive as
  message lists (TRL's conversational format)."""

from __future__ import annotations

import re

SYSTEM = ("Reason step by step inside <think> </think>, then give the final number inside "
          "<answer> </answer>.")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_THINK_THEN_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def prompt_transform(cfg, *args, **kwargs):
    def map_fn(example, tokenizer=None):
        return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["question"]}],
                "answer": example["answer"].split("####")[-1].strip()}  # GSM8K's final line: "#### 72"

    return map_fn, {"remove_columns": ["question"]}  # "answer" stays: the accuracy reward reads it


def _number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1 when the <answer> tag holds the reference number."""
    rewards = []
    for completion, reference in zip(completions, answer):
        found = _ANSWER.search(completion[0]["content"])
        rewards.append(float(found is not None and _number(found.group(1)) == _number(reference)))
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1 for <think>...</think> followed by <answer>...</answer> and nothing else."""
    return [float(bool(_THINK_THEN_ANSWER.match(completion[0]["content"].strip()))) for completion in completions]
