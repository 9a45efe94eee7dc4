"""reasoning-gym's verifiers as a reward: the answer a completion gives in <answer>...</answer> (the last
such tag, found by reasoning-gym's own extract_answer), scored by its task's score_answer(answer, entry),
a float in [0, 1]. The rows come from `data.source: reasoning_gym:<task>` (driver/data/reasoning_gym.py),
whose `entry` and `task` columns are all a process needs: the dataset is rebuilt from `task` once per
process, so the reward runs the same in reward workers (`rewards.reward_num_workers`) as inline.

A completion without the tag is scored as reasoning-gym scores a missing answer (score_answer(None,
entry): 0 for every task). A verifier that raises on an answer (a few parse it without a guard, e.g.
prime_factorization on "x") could not read it: 0, with one warning per task and error type, rather
than a failed run over a malformed completion. None only for a row without an entry.

Light to import (reasoning-gym is loaded at the first call), as every reward a worker imports.
"""

from __future__ import annotations

import logging

from driver.data.conversation import completion_text
from driver.data.reasoning_gym import import_reasoning_gym, task_dataset

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()  # (task, error type) of the verifier failures logged in this process


def score(prompts: list, completions: list, entry: list[dict | None] | None = None,
          task: list[str | None] | None = None, **columns) -> list[float | None]:
    """TRL's signature; `entry` and `task` are the columns of a reasoning_gym:<task> source."""
    if entry is None or task is None:
        raise ValueError("driver.rewards.reasoning_gym.score needs the columns `entry` and `task` that data.source "
                         f"reasoning_gym:<task> makes; this data has {sorted(columns) or 'no other columns'}")
    extract_answer = import_reasoning_gym().utils.extract_answer
    rewards = []
    for completion, row_entry, row_task in zip(completions, entry, task):
        if row_entry is None or row_task is None:
            rewards.append(None)
            continue
        dataset = task_dataset(row_task)  # outside the try: an unknown task or a missing install is an error
        answer = extract_answer(completion_text(completion))
        try:
            rewards.append(float(dataset.score_answer(answer, row_entry)))
        except Exception as error:  # the verifier could not read this answer (see the module docstring)
            warning = (row_task.partition("?")[0], type(error).__name__)
            if warning not in _warned:
                _warned.add(warning)
                logger.warning("reasoning-gym's %s verifier raised %s on the answer %r, scored 0 (warned once): %s",
                               *warning, str(answer)[:80], str(error)[:200])
            rewards.append(0.0)
    return rewards
