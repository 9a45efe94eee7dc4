"""algo.kl_in_reward (verl's use_kl_in_reward): beta x KL(policy || base) summed over each completion's
tokens, subtracted from its reward before advantages, instead of a KL term in the loss. Computed at
assembly, in the trainer's thread, by two no-grad passes over the step's groups: the policy being
updated (verl's old_log_prob) and the base with the adapter disabled (the reference). Under torchrun
these are forwards of the sharded model: every rank computes a contiguous share of the rows
(driver/rollouts/distributed_feed.py on_all_ranks) for rank 0, which assembles the step."""

from __future__ import annotations

import torch

from driver.config import Config
from driver.data.records import Group
from driver.distributed import world as distributed
from driver.policy.kl import kl_estimate
from driver.policy.logprobs import completion_logprobs, pack
from driver.policy.model import Policy, evaluating
from driver.rollouts.distributed_feed import on_all_ranks


def set_kl_penalties(config: Config, policy: Policy, groups: list[Group]) -> None:
    """group.kl_penalty = -beta x sum over the completion's tokens of algo.kl_estimator, [G] per group."""
    rows = [(group, sample) for group in groups for sample in group.samples]
    prompts = [group.prompt.token_ids for group, _ in rows]
    completions = [list(sample.token_ids) for _, sample in rows]
    size = distributed.world().size
    bounds = [len(rows) * rank // size for rank in range(size + 1)]
    shares = [(prompts[a:b], completions[a:b]) for a, b in zip(bounds, bounds[1:])]
    flat = torch.cat(on_all_ranks(kl_penalties_of_share, shares, config, policy))
    start = 0
    for group in groups:
        group.kl_penalty, start = flat[start:start + len(group.samples)], start + len(group.samples)


@torch.no_grad()
def kl_penalties_of_share(config: Config, policy: Policy,
                          share: tuple[list[list[int]], list[list[int]]]) -> torch.Tensor:
    """[n] -beta x summed KL of this rank's (prompts, completions), train.micro_batch_size at a time; as many
    passes as the busiest rank runs (FSDP's collectives pair up)."""
    prompts, completions = share
    size, temperature = config.train.micro_batch_size, config.rollout.sampling.temperature
    starts = range(0, len(prompts), size)
    padding = distributed.max_int(len(starts)) - len(starts)
    penalties = []
    with evaluating(policy.model):
        for start in starts:
            packed = pack(prompts[start:start + size], completions[start:start + size], device=policy.device)
            logps, _, mask = completion_logprobs(policy.model, packed, temperature)
            with policy.reference() as model:
                ref_logps, _, _ = completion_logprobs(model, packed, temperature)
            kl = kl_estimate(logps, ref_logps, mask > 0, config.algo.kl_estimator).sum(dim=1)
            penalties.append(-config.algo.beta * kl.float().cpu())
        for _ in range(padding):
            packed = pack([[0]], [[0]], device=policy.device)
            completion_logprobs(policy.model, packed, temperature)
            with policy.reference() as model:
                completion_logprobs(model, packed, temperature)
    return torch.cat(penalties) if penalties else torch.zeros(0)
