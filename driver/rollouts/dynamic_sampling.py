"""DAPO's dynamic sampling (arXiv 2503.14476, verl's algorithm.filter_groups): every step trains on a
full quota of groups WITH SIGNAL, generating more prompts while zero-signal groups leave it short.

A group has signal when the scorer gives it, on its own, an advantage that is not all zero: its rewards
are not all equal (DAPO's "0 < |correct| < G"; GDPO: some reward function's are not), judged before any
KL penalty (algo.kl_in_reward), so on the task reward alone (verl's metric "seq_reward"). Zero-signal
groups are dropped and their prompts consumed, as in DAPO; groups whose scoring failed count as
zero-signal here (re-rolled later or an error, as without dynamic sampling). While fewer than the quota
have signal, an extra round generates more groups for the same step and version: the missing ones
divided by the fraction of the step's groups so far that had signal, at most a step's quota (the
quota when none had), so one round usually fills the step without generating a full batch for the
last few places. At most algo.dynamic_sampling_max_rounds extra rounds (verl's max_num_gen_batches - 1);
when they run out the step trains on the groups it has (verl raises instead), the shortfall shown by
dynamic_sampling/filled_fraction and refilled from the replay buffer when there is one; a step that
found no group with signal at all is assembled from its first job as without dynamic sampling (the
update needs rows: with zero_advantage filter it becomes a zero-gradient step). Beyond the quota the
first groups by group id are kept.

Only the selection happens here: the caller computes the advantages over exactly the kept groups
(batch-level estimators such as reinforce_plus_plus or scale_rewards batch need the final set), after
their KL penalty. Runs in the trainer's thread with the producer idle: the synchronous loop only
(driver/config.py refuses rollout.async_prefetch), so a checkpoint's producer state already includes
every prompt the extra rounds took.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from driver.data.records import Group
from driver.rewards.scorer import Scorer
from driver.rollouts.producer import Job

SUMMED_JOB_METRICS = ("time/generation", "rollout/rounds", "rollout/dropped_stale", "rollout/regenerated_stale",
                      "partial/continued_samples")  # the rest are the last round's


@dataclass
class Selection:
    job: Job  # the step's job: the kept groups and those whose scoring failed, in group-id order
    without_signal: list[Group]  # dropped, scored (total set): re-roll still sees the failed ones
    signal_found: bool  # False: no group had signal, job is the first job (assembled as without dynamic sampling)
    reward_wait: float  # seconds waited for the extra rounds' rewards


def has_signal(scorer: Scorer, group: Group) -> bool:
    """Sets the group's total and advantages as the scorer gives them to the group alone (the step's
    assembly replaces them for the groups it keeps); True when an advantage is not exactly zero."""
    group.total, group.advantages, _ = scorer.advantages([group])
    return bool(group.advantages.any())


def select_groups_with_signal(first: Job, scorer: Scorer, max_rounds: int,
                              produce_more: Callable[[int], Job], score: Callable[[Job], float]) -> Selection:
    """first: the step's job, scored; its size is the step's quota (Producer.produce). produce_more(n):
    n more groups for the same step and version; score(job): scores its groups, returns the seconds waited."""
    quota, jobs, reward_wait = len(first.groups), [first], 0.0
    with_signal, without_signal, failed = [], [], []
    while True:
        for group in jobs[-1].groups:
            if group.failure is not None:
                failed.append(group)
            else:
                (with_signal if has_signal(scorer, group) else without_signal).append(group)
        missing = quota - len(with_signal)
        if missing <= 0 or len(jobs) > max_rounds:
            break
        generated = sum(len(job.groups) for job in jobs)
        count = min(quota, math.ceil(missing * generated / len(with_signal))) if with_signal else quota
        jobs.append(produce_more(count))
        reward_wait += score(jobs[-1])
    kept = sorted(with_signal, key=lambda group: group.group_id)[:quota]
    groups = kept + failed
    if not kept:  # an empty step cannot be trained on: the first job's groups, as without dynamic sampling
        first_ids = {group.group_id for group in first.groups}
        groups = first.groups + [group for group in failed if group.group_id not in first_ids]
        without_signal = [group for group in without_signal if group.group_id not in first_ids]
    metrics = {**merged_job_metrics(jobs),
               "dynamic_sampling/rounds": float(len(jobs) - 1),
               "dynamic_sampling/generated_groups": float(sum(len(job.groups) for job in jobs)),
               "dynamic_sampling/groups_with_signal": float(len(with_signal)),
               "dynamic_sampling/filled_fraction": len(kept) / quota if quota else 1.0}
    groups = sorted(groups, key=lambda group: group.group_id)
    return Selection(Job(first.index, first.version, groups, metrics), without_signal, bool(kept), reward_wait)


def merged_job_metrics(jobs: list[Job]) -> dict[str, float]:
    """The generation metrics of one step's rounds: counts and times summed, the rest the last round's."""
    metrics = {key: value for job in jobs for key, value in job.metrics.items()}
    for key in SUMMED_JOB_METRICS:
        if key in metrics:
            metrics[key] = sum(job.metrics.get(key, 0.0) for job in jobs)
    return metrics
