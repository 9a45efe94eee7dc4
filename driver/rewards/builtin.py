"""Reward functions that come with the driver and fit any task (the task-specific ones live with their
data: driver/data/toy_tasks.py, driver/data/gsm8k.py). Each is TRL's reward of the same name, with
TRL's values and its name in the logs (`rewards/<name>/*` match a TRL run's): a function
(`{path: driver.rewards.builtin.think_format_reward}`), or a factory `get_<name>(settings) -> reward`
named with its arguments in `kwargs` (docs/rewards.md), whose reward is a picklable callable (reward
workers may receive it by pickle, as TRL's async workers do):
`{path: driver.rewards.builtin.get_soft_overlong_punishment, kwargs: {max_completion_len: 256, soft_punish_cache: 64}}`.

Standard library only: a reward worker that imports it loads no torch.
"""

from __future__ import annotations

import re

from driver.data.conversation import completion_text

# TRL's pattern: the completion opens with <think>, closes it once, and holds no second <think>.
_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **columns) -> list[float]:
    """1.0 where the completion's reasoning is enclosed in one leading `<think>...</think>`, else 0.0
    (TRL's trl.rewards.think_format_reward). A completion is its text, or for chat data the one
    assistant message the driver passes (TRL reads its first message, we its last: the same one).
    A chat template that opens the think block in the prompt (DeepSeek-R1's) leaves `<think>` out of
    every completion: each scores 0, as in TRL."""
    return [1.0 if _THINK_FORMAT.match(completion_text(completion)) else 0.0 for completion in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13; TRL's trl.rewards function of this
    name). For a completion of L tokens, L_max = max_completion_len, L_cache = soft_punish_cache:

        0                               if L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache if L_max - L_cache < L <= L_max   (0 down to -1)
        -1                              if L > L_max

    L counts completion tokens (`completion_ids`, what the engine sampled: a final end-of-sequence token
    included when it stopped on one), never characters. With L_max = rollout.sampling.max_tokens no
    completion exceeds L_max, so only the linear ramp applies; L_cache = 0 punishes nothing up to L_max.
    """
    if not isinstance(max_completion_len, int) or max_completion_len < 1:
        raise ValueError(f"max_completion_len must be a positive number of tokens, got {max_completion_len!r}")
    if not isinstance(soft_punish_cache, int) or not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache must be a number of tokens in [0, max_completion_len = "
                         f"{max_completion_len}], got {soft_punish_cache!r}")
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class SoftOverlongPunishment:
    """The reward get_soft_overlong_punishment returns: a class, not a closure, so that it pickles."""

    __name__ = "soft_overlong_punishment_reward"  # TRL's: the reward's name in the logs

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **columns) -> list[float]:
        """One penalty in [-1, 0] per completion; prompts, completions and dataset columns are ignored."""
        free = self.max_completion_len - self.soft_punish_cache  # tokens allowed before any punishment
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_len:  # free < length: soft_punish_cache > 0 here
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards
