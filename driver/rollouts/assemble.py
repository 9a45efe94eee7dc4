"""A generation job's scored groups -> the step's RolloutBatch, in the trainer's thread.

In order: rewards (already computed while the job generated when scoring streams), groups whose
scoring failed after its retry (re-rolled later, or a RewardError naming the reward and input),
with algo.dynamic_sampling only the groups with signal, more generated until the step is full
(driver/rollouts/dynamic_sampling.py), advantages over the step's groups (the scorer's: batch
scaling needs all of them; GRPO: driver/rewards/group_scorer.py, EBFT: driver/ebft/structured.py),
groups that failed entirely re-queued for a later re-roll, high-signal groups kept for replay, then
the batch: zero-advantage rows filtered out before any logprob pass (the loss keeps the unfiltered
normalization: driver/rollouts/filtering.py) and the filtered groups' places (with dynamic sampling:
those its rounds left empty) refilled from the replay buffer.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from driver.config import Config
from driver.data.records import Group
from driver.metrics.logger import TOKENS_IN_STEP, json_safe
from driver.rewards.functions import RewardError
from driver.rewards.scorer import Scorer
from driver.environments.episodes import episode_stats
from driver.rollouts.batch import RolloutBatch, batch_from_groups
from driver.rollouts.dynamic_sampling import select_groups_with_signal
from driver.rollouts.filtering import extend_batch, filter_zero_advantage
from driver.rollouts.producer import Job
from driver.rollouts.replay import ReplayBuffer
from driver.rollouts.reroll import RerollQueue, failed_entirely
from driver.rollouts.schedule import staleness


def score_groups(scorer: Scorer, groups: list[Group], submit: bool) -> float:
    """Rewards of every group (submitting them first unless scoring streamed); returns the seconds waited."""
    started = time.perf_counter()
    if submit:
        for group in groups:
            scorer.submit_group(group)
    results = scorer.wait([group.group_id for group in groups])
    for group in groups:
        result = results[group.group_id]
        group.rewards, group.failure = result.table, result.failure
    return time.perf_counter() - started


def score_job(scorer: Scorer, job: Job, submit: bool, rerolling: bool) -> float:
    """score_groups over the job's groups, its groups dropped as stale forgotten; a group whose scoring
    failed is a RewardError unless failed groups are re-rolled. Returns the seconds waited."""
    if not submit:
        scorer.discard(job.dropped)  # scored as they finished, then found too old to train on
    reward_wait = score_groups(scorer, job.groups, submit)
    failed = [group for group in job.groups if group.failure is not None]
    if failed and not rerolling:
        raise RewardError(f"{len(failed)} group(s) could not be scored (set algo.reroll_failed to re-roll them "
                          f"later instead); first: {failed[0].failure}")
    return reward_wait


def assemble(config: Config, job: Job, step: int, scorer: Scorer, submit: bool,
             replay: ReplayBuffer | None, reroll: RerollQueue | None,
             kl_penalty: Callable[[list[Group]], None] | None = None,
             produce_more: Callable[[int], Job] | None = None) -> RolloutBatch:
    """submit: the job's groups still need scoring (rewards in this process, under prefetch: they
    must run here, in the main thread); otherwise they were submitted as they finished. kl_penalty
    (algo.kl_in_reward): sets each group's KL penalty before the advantages. produce_more(n)
    (algo.dynamic_sampling): n more groups for this step, generated in this thread."""
    score = functools.partial(score_job, scorer, submit=submit, rerolling=reroll is not None)
    quota, reward_wait = len(job.groups), score(job)  # Producer.produce: a job holds a step's quota of groups
    without_signal, dynamic = [], False
    if produce_more is not None:  # keeps the groups with signal, generating more; advantages follow over them
        selection = select_groups_with_signal(job, scorer, config.algo.dynamic_sampling_max_rounds, produce_more,
                                              score)
        job, without_signal, dynamic = selection.job, selection.without_signal, selection.signal_found
        reward_wait += selection.reward_wait
    failed = [group for group in job.groups if group.failure is not None]
    groups = [group for group in job.groups if group.failure is None]
    metrics = dict(job.metrics)
    if groups:
        if kl_penalty is not None:
            kl_penalty(groups)
        total, advantages, stats = scorer.advantages(groups)
        metrics.update(stats)
        for index, group in enumerate(groups):
            rows = slice(index * config.algo.num_generations, (index + 1) * config.algo.num_generations)
            group.total, group.advantages = total[rows], advantages[rows]
    if reroll is not None:
        for group in failed + groups + without_signal:
            if failed_entirely(group, config.algo.reroll_threshold):
                reroll.push(group, step)
        metrics.update(reroll.metrics())
    ground_truth_ids = scorer.ground_truth_ids  # for a loss term on them (EBFT's ce_coef), or None
    batch = batch_from_groups(groups, [group.texts for group in groups],
                              mask_truncated=config.algo.mask_truncated_completions, ground_truth_ids=ground_truth_ids)
    batch.table = completions_table(groups, getattr(scorer, "names", None))
    metrics.update(completion_stats(groups))
    metrics.update(episode_stats(groups))
    micro_batch_size = config.train.micro_batch_size
    every_row = config.algo.acts_on_every_completion
    if config.algo.zero_advantage == "filter":
        batch, filter_metrics = filter_zero_advantage(batch, micro_batch_size, every_row=every_row)
        metrics.update(filter_metrics)
    if replay is not None:
        if dynamic:  # the places dynamic sampling could not fill in its rounds
            empty_places = quota - len(groups)
        else:  # the places of the groups filtered for zero advantage
            empty_places = (sum(not bool(group.advantages.any()) for group in groups)
                            if config.algo.zero_advantage == "filter" and not every_row else 0)
        replayed = replay.take(empty_places, step) if empty_places else []
        replay.add(groups, step)  # after taking: a group is never trained twice in one step
        if replayed:
            replayed_batch = batch_from_groups(replayed, [group.texts for group in replayed],
                                               mask_truncated=config.algo.mask_truncated_completions,
                                               ground_truth_ids=ground_truth_ids)
            batch = extend_batch(batch, replayed_batch, micro_batch_size)
        metrics.update(replay.metrics())
        metrics["replay/replayed_groups"] = float(len(replayed))
    metrics.update(staleness_stats(batch, step))
    metrics.update({"rewards/failed_groups": float(len(failed)), "time/reward_wait": reward_wait,
                    **scorer.metrics()})
    batch.metrics = metrics
    return batch


def staleness_stats(batch: RolloutBatch, step: int) -> dict[str, float]:
    ages = [staleness(step, version) for version in batch.versions]
    if not ages:
        return {}
    return {"rollout/staleness_mean": sum(ages) / len(ages), "rollout/staleness_max": float(max(ages))}


def completion_stats(groups: list[Group]) -> dict[str, float]:
    """TRL's completions/* metrics (terminated: ended by the model, not cut at max_tokens; 0 when none
    was, as TRL), num_input_tokens (the step's prompt + completion tokens, which the logger sums into
    TRL's num_tokens) and the fraction of samples continued over several rounds (partial rollouts)."""
    samples = [sample for group in groups for sample in group.samples]
    if not samples:
        return {}
    lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.float32)
    terminated = torch.tensor([len(s.token_ids) for s in samples if s.finish_reason == "stop"], dtype=torch.float32)
    continued = sum(len(s.spans) > 1 for s in samples)
    prompt_tokens = sum(len(group.prompt.token_ids) * len(group.samples) for group in groups)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(sum(s.finish_reason == "length" for s in samples) / len(samples)),
        "completions/mean_terminated_length": float(terminated.mean()) if len(terminated) else 0.0,
        "completions/min_terminated_length": float(terminated.min()) if len(terminated) else 0.0,
        "completions/max_terminated_length": float(terminated.max()) if len(terminated) else 0.0,
        "completions/continued_fraction": continued / len(samples),
        TOKENS_IN_STEP: float(prompt_tokens + lengths.sum()),
    }


def completions_table(groups: list[Group], names: list[str] | None) -> list[dict]:
    """One row per completion: prompt, completion, total reward, advantage and each reward function's
    value (null where it returned None), as TRL's completions table."""
    rows = []
    for group in groups:
        for index, text in enumerate(group.texts or []):
            row = {"prompt": group.prompt.text, "completion": text,
                   "reward": json_safe(float(group.total[index])) if group.total is not None else None,
                   "advantage": (json_safe(float(group.advantages[index])) if group.advantages is not None
                                 else None)}
            if group.rewards is not None and names is not None:
                row.update({f"rewards/{name}": json_safe(float(value))
                            for name, value in zip(names, group.rewards[index])})
            rows.append(row)
    return rows

