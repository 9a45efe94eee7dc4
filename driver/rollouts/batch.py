"""The rollout batch the update trains on, and how groups of samples become one.

Tokens stay lists (the update packs them into one row, no padding in the model); only the
per-token sampling logprobs and the completion mask are [N, T] tensors, right-padded to the
longest completion of the batch, whatever batch their group was generated in (replayed groups
are re-padded to the width of the batch they join).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from driver.data.prompts import Prompt
from driver.data.records import Group


@dataclass
class RolloutBatch:
    prompt_ids: list[list[int]]  # one entry per completion (each prompt repeated num_generations times)
    completion_ids: list[list[int]]
    sampling_logprobs: torch.Tensor  # [N, T] the engine's logprobs of the sampled tokens, 0 on padding
    mask: torch.Tensor  # [N, T] 1.0 on completion tokens
    advantages: torch.Tensor  # [N]
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[str, str, float]] = field(default_factory=list)  # (prompt, completion, reward)
    versions: list[int] = field(default_factory=list)  # [N] oldest adapter version of each row's tokens
    counts: Any = None  # driver.rollouts.filtering.StepCounts of the batch before zero-advantage filtering
    table: list[dict] = field(default_factory=list)  # every completion of the step, before filtering (the logs')
    # [N] the token ids of each row's ground truth, for an update with a cross-entropy term on it
    # (driver/update/ground_truth_loss.py); empty: none
    ground_truth_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def to(self, device: torch.device) -> RolloutBatch:
        return replace(self, sampling_logprobs=self.sampling_logprobs.to(device), mask=self.mask.to(device),
                       advantages=self.advantages.to(device))

    def select(self, rows: list[int], counts: Any) -> RolloutBatch:
        """The batch of the given rows, in that order, with its padding cut to the longest kept
        completion, carrying `counts` (the one row selection: zero-advantage filtering, sharding)."""
        index = torch.tensor(rows, dtype=torch.long)
        width = max((len(self.completion_ids[row]) for row in rows), default=0)
        return replace(
            self,
            prompt_ids=[self.prompt_ids[row] for row in rows],
            completion_ids=[self.completion_ids[row] for row in rows],
            sampling_logprobs=self.sampling_logprobs[index.to(self.sampling_logprobs.device), :width],
            mask=self.mask[index.to(self.mask.device), :width],
            advantages=self.advantages[index.to(self.advantages.device)],
            samples=[self.samples[row] for row in rows] if self.samples else [],
            versions=[self.versions[row] for row in rows] if self.versions else [],
            counts=counts,
            ground_truth_ids=[self.ground_truth_ids[row] for row in rows] if self.ground_truth_ids else [])


def padded_rows(rows: list[list[float]], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [N, width] fp32 right-padded with 0, mask [N, width]) from ragged rows."""
    width = max((len(row) for row in rows), default=0) if width is None else width
    values = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    for index, row in enumerate(rows):
        values[index, : len(row)] = torch.tensor(row, dtype=torch.float32)
        mask[index, : len(row)] = 1.0
    return values, mask


def batch_from_groups(groups: list[Group], texts: list[list[str]] | None = None, mask_truncated: bool = False,
                      ground_truth_ids: Callable[[Prompt], list[int]] | None = None) -> RolloutBatch:
    """Rows group after group, sample after sample; every group needs its advantages set.

    texts: the decoded completions per group, for the samples shown in the logs. mask_truncated (DAPO's
    mask_truncated_completions): completions cut at max_tokens keep their rows, with an all-zero mask, so
    no loss term and no normalizer counts their tokens (TRL zeroes their completion mask the same way).
    ground_truth_ids(prompt): each row's ground truth ids, when the update trains on them."""
    samples = [sample for group in groups for sample in group.samples]
    sampling, mask = padded_rows([sample.logprobs for sample in samples])
    for row, sample in enumerate(samples):  # an episode's environment tokens: no loss, no importance weight
        for start, end in sample.episode.environment_spans if sample.episode is not None else ():
            mask[row, start:end] = 0.0
    if mask_truncated:
        truncated = torch.tensor([sample.finish_reason == "length" for sample in samples], dtype=torch.bool)
        mask[truncated] = 0.0
    shown = []
    if texts is not None:
        shown = [(group.prompt.text, text, float(reward)) for group, group_texts in zip(groups, texts)
                 for text, reward in zip(group_texts, group.total)]
    advantages = torch.cat([group.advantages for group in groups]) if groups else torch.zeros(0)
    return RolloutBatch(
        prompt_ids=[group.prompt.token_ids for group in groups for _ in group.samples],
        completion_ids=[list(sample.token_ids) for sample in samples],
        sampling_logprobs=sampling, mask=mask, advantages=advantages.float(), samples=shown,
        versions=[sample.version for sample in samples],
        ground_truth_ids=([ground_truth_ids(group.prompt) for group in groups for _ in group.samples]
                          if ground_truth_ids is not None else []))
