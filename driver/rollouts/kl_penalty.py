"""algo.kl_in_reward (verl's use_kl_in_reward): beta x KL(policy || base) summed over each completion's
tokens, subtracted from its reward before advantages, instead of a KL term in the loss. Computed at
assembly, in the trainer's thread, by two no-grad passes over the step's groups: the policy being
updated (verl's old_log_prob) and the base with the adapter disabled (the reference). One process only:
under torchrun these passes would be collectives that only the rank assembling the step runs."""

from __future__ import annotations

import torch

from driver.config import Config
from driver.data.records import Group
from driver.policy.kl import kl_estimate
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import Policy, evaluating


@torch.no_grad()
def set_kl_penalties(config: Config, policy: Policy, groups: list[Group]) -> None:
    """group.kl_penalty = -beta x sum over the completion's tokens of algo.kl_estimator, [G] per group."""
    rows = [(group, sample) for group in groups for sample in group.samples]
    penalties, size = [], config.train.micro_batch_size
    temperature = config.rollout.sampling.temperature
    with evaluating(policy.model):
        for start in range(0, len(rows), size):
            part = rows[start:start + size]
            packed = pack([group.prompt.token_ids for group, _ in part], [list(sample.token_ids) for _, sample in part],
                          device=policy.device)
            logps, _, mask = completion_logprobs(policy.model, packed, temperature)
            with policy.reference() as model:
                ref_logps, _, _ = completion_logprobs(model, packed, temperature)
            kl = kl_estimate(logps, ref_logps, mask > 0, config.algo.kl_estimator).sum(dim=1)
            penalties.append(-config.algo.beta * kl.float().cpu())
    flat = torch.cat(penalties) if penalties else torch.zeros(0)
    start = 0
    for group in groups:
        group.kl_penalty, start = flat[start:start + len(group.samples)], start + len(group.samples)
