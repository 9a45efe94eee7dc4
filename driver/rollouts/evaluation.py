"""Evaluation (the eval section): every eval prompt sampled by one adapter version (with rollout.sampling, or at
eval.temperature: 0 is greedy), scored by the run's reward functions, summarized under eval/ with TRL's metric
names (eval/reward, eval/rewards/<name>/mean, eval/completions/mean_length, ...).

It runs in the trainer's thread right after a sync, while the engine serves that step's adapter, and holds
the engine for the generation only: a prefetch thread's next job waits for it, but which version samples
which job does not change, so a run with evaluations trains exactly as one without. Generation goes through
a Producer of its own (multi-turn episodes, NeMo Gym agents and partial rollouts as in training), whose
groups take ids no training group reaches and the same sampling seeds every time: two evaluations differ by
the adapter alone, not by the luck of the draw.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from driver.cli import ConfigError
from driver.config import Config, eval_prefix
from driver.data.prompts import PromptSource
from driver.data.records import Group
from driver.engine.base import Generator
from driver.environments.episodes import episode_stats
from driver.environments.factory import episode_runner
from driver.metrics.logger import TOKENS_IN_STEP
from driver.rewards.advantages import combine_rewards
from driver.rewards.group_scorer import GroupScorer
from driver.rollouts.agent_runs import AgentRuns
from driver.rollouts.assemble import completion_stats, completions_table, score_groups
from driver.rollouts.producer import Producer

# Eval groups' ids (their reward calls' keys and sampling seeds) start here, each set's SET_ID_SPAN after the one
# before; training's count up from 0.
FIRST_EVAL_GROUP_ID = 1 << 48
SET_ID_SPAN = 1 << 40


@dataclass
class Evaluation:
    metrics: dict[str, float]  # eval/...
    table: list[dict]  # a row per completion: prompt, completion, reward, each reward function's value
    failure: str | None  # the first group whose scoring failed: which reward, how, on what input


def check_best_metric(config: Config, reward_names) -> None:
    """eval.best_metric must name a reward metric every scored evaluation has (with eval.sets, one of a set's:
    <set>/<metric>): a ConfigError before training."""
    per_function = [f"rewards/{name}/{stat}" for name in reward_names for stat in ("mean", "std")]
    decisive = ["reward", "reward_std", *per_function]
    if config.eval.sets:
        decisive = [f"{label}/{metric}" for label in config.eval.sets for metric in decisive]
    if config.eval.save_best and config.eval.best_metric not in decisive:
        raise ConfigError(f"eval.best_metric: {config.eval.best_metric} is none of the evaluations' reward metrics "
                          f"({', '.join(decisive)})")


class Evaluator:
    def __init__(self, config: Config, generator: Generator, prompts: dict[str, PromptSource], tokenizer,
                 scorer: GroupScorer, agent: AgentRuns | None = None, training: PromptSource | None = None) -> None:
        """prompts: each evaluation set's, by label ("": the one set; driver/data/eval_prompts.py). scorer: the run's
        reward functions (their worker processes are shared with training: eval groups are submitted and
        collected under ids of their own). training: the training prompts, whose progress is the epoch the
        rewards' trainer_state says."""
        count = config.eval.generations(config.algo.num_generations)
        # The producer and the reward statistics read the group size from the algo section.
        self.config = config.model_copy(update={"algo": config.algo.model_copy(update={"num_generations": count})})
        self.generator, self.prompts, self.tokenizer, self.scorer = generator, prompts, tokenizer, scorer
        self.agent, self.training = agent, training
        self.episodes = episode_runner(self.config, tokenizer)

    def evaluate(self, version: int, engine_lock: threading.Lock) -> Evaluation:
        """Adapter `version`'s evaluation of every set, one after the other; the engine serves it. A group whose
        scoring failed is counted (eval/failed_groups) and left out of the rewards: an evaluation does not stop
        the run."""
        evaluations = [self._evaluate_set(label, index, version, engine_lock)
                       for index, label in enumerate(self.prompts)]
        failures = [evaluation.failure for evaluation in evaluations if evaluation.failure is not None]
        return Evaluation({key: value for evaluation in evaluations for key, value in evaluation.metrics.items()},
                          [row for evaluation in evaluations for row in evaluation.table],
                          failures[0] if failures else None)

    def _evaluate_set(self, label: str, index: int, version: int, engine_lock: threading.Lock) -> Evaluation:
        started = time.perf_counter()
        groups = self._generate(self.prompts[label], FIRST_EVAL_GROUP_ID + index * SET_ID_SPAN, version, engine_lock)
        score_groups(self.scorer, groups, submit=True)
        failed = [group for group in groups if group.failure is not None]
        scored = [group for group in groups if group.failure is None]
        metrics = {"version": float(version), "prompts": float(len(groups)), "failed_groups": float(len(failed))}
        metrics.update(self._reward_stats(scored))
        metrics.update({key: value for key, value in completion_stats(groups).items() if key != TOKENS_IN_STEP})
        metrics.update(episode_stats(groups))
        metrics["time"] = time.perf_counter() - started
        table = [{**({"set": label} if label else {}), **{key: value for key, value in row.items()
                                                           if key != "advantage"}}  # nothing is trained on
                 for row in completions_table(scored, list(self.scorer.names))]
        return Evaluation({eval_prefix(label) + key: value for key, value in metrics.items()}, table,
                          failed[0].failure if failed else None)

    def _generate(self, prompts: PromptSource, first_group_id: int, version: int,
                  engine_lock: threading.Lock) -> list[Group]:
        prompts.load_state_dict({"epoch": 0, "position": 0, "prompts": len(prompts.prompts)})
        producer = Producer(self.config, self.generator, prompts, self.tokenizer, episodes=self.episodes,
                            agent=self.agent)
        producer.next_group_id = first_group_id
        producer.quota = len(prompts.prompts)  # every prompt in the first round: one batch for the engine
        producer.temperature = self.config.eval.temperature
        if self.training is not None:
            producer.progress = self.training
        with engine_lock:
            return producer.produce(version, version).groups

    def _reward_stats(self, groups: list[Group]) -> dict[str, float]:
        """TRL's reward metrics over the scored groups; each group's total reward kept for the table."""
        if not groups:
            return {}
        size = self.config.algo.num_generations
        total, _, stats = combine_rewards(torch.cat([group.rewards for group in groups]), self.scorer.weights, size,
                                          self.config.rewards.aggregation, self.config.algo.scale_rewards,
                                          names=list(self.scorer.names))
        for index, group in enumerate(groups):
            group.total = total[index * size:(index + 1) * size]
        return stats
