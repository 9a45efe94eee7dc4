"""What a step logs about its completions (TRL's names): completions/* lengths, the tokens behind
num_tokens, and the completions table, against values counted by hand; merged batches (gradient
accumulation) sum their tokens and keep every table row."""

import math

import torch

from driver.data.prompts import Prompt
from driver.data.records import Group, Sample, Span
from driver.metrics.logger import TOKENS_IN_STEP
from driver.rollouts.assemble import completion_stats, completions_table
from driver.rollouts.batch import batch_from_groups
from driver.rollouts.filtering import merge


def group(group_id, lengths_and_reasons, rewards):
    samples = [Sample(list(range(n)), [-1.0] * n, reason, [Span(0, n, 0)]) for n, reason in lengths_and_reasons]
    table = torch.tensor(rewards, dtype=torch.float32)
    total = table.nan_to_num(0).sum(dim=1)
    return Group(group_id, Prompt(group_id, f"p{group_id}", [1] * (group_id + 2)), samples, rewards=table,
                 total=total, advantages=total - total.mean(), texts=[f"c{n}" for n, _ in lengths_and_reasons])


GROUPS = [group(0, [(4, "stop"), (9, "length")], [[1.0, 0.5], [0.0, math.nan]]),
          group(1, [(2, "stop"), (6, "stop")], [[0.25, 0.0], [1.0, 1.0]])]


def test_completion_stats_count_as_trl():
    stats = completion_stats(GROUPS)
    assert (stats["completions/mean_length"], stats["completions/min_length"], stats["completions/max_length"]) == \
        (21 / 4, 2.0, 9.0)
    assert stats["completions/clipped_ratio"] == 0.25
    assert (stats["completions/mean_terminated_length"], stats["completions/min_terminated_length"],
            stats["completions/max_terminated_length"]) == (4.0, 2.0, 6.0)
    assert stats[TOKENS_IN_STEP] == (2 * 2 + 3 * 2) + 21  # prompts (2 and 3 tokens, twice each) + completions
    none_finished = completion_stats([group(2, [(3, "length")], [[0.0, 0.0]])])
    assert none_finished["completions/min_terminated_length"] == 0.0  # TRL's 0 when none terminated


def test_completions_table_rows():
    rows = completions_table(GROUPS, ["accuracy", "format"])
    assert len(rows) == 4 and rows[0] == {"prompt": "p0", "completion": "c4", "reward": 1.5, "advantage": 0.75,
                                          "rewards/accuracy": 1.0, "rewards/format": 0.5}
    assert rows[1]["rewards/format"] is None  # the function returned None: null, not NaN (JSON has no NaN)


def test_merged_batches_sum_their_tokens_and_keep_every_row():
    batches = []
    for g in GROUPS:
        batch = batch_from_groups([g], [g.texts])
        batch.metrics, batch.table = completion_stats([g]), completions_table([g], None)
        batches.append(batch)
    merged = merge(batches)
    assert merged.metrics[TOKENS_IN_STEP] == completion_stats(GROUPS)[TOKENS_IN_STEP]
    assert [row["completion"] for row in merged.table] == ["c4", "c9", "c2", "c6"]
