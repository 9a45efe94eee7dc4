"""The training algorithms, registered once and dispatched once: what GRPO and EBFT do differently.

Everything else (the loop, generation, filtering, replay, re-rolls, checkpoints) is shared, and asks
the run's `algorithm(config)`, never the name:
  make_scorer(config, policy)   -> (Scorer, max_tokens(prompt) or None): what scores the groups and
                                   turns their rewards into advantages (driver/rewards/scorer.py), and
                                   each group's completion budget when the algorithm sizes it
  check_prompts(config, prompts)   dataset checks made before the first step
  trainer_sampling(config)      -> TrainerSampling (the batch source and the update of a mode in which
                                   the trainer samples its own rollouts, no inference engine: EBFT's
                                   strided mode), or None: vLLM generates, driver/update/step.py trains
  single_process                   why it does not run under torchrun yet, or None
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from driver.config import Config
from driver.data.prompts import PromptSource
from driver.policy.model import Policy
from driver.rewards.group_scorer import reward_function_scorer
from driver.rewards.scorer import Scorer

ScorerFactory = Callable[[Config, Policy], tuple[Scorer, Callable | None]]


@dataclass(frozen=True)
class TrainerSampling:
    """A mode that samples in the trainer: make_source(config, policy, prompts, rollout_state) gives
    its driver.rollouts.source.BatchSource and update(config, policy, batch, optimizer, scheduler)
    -> metrics trains on its batches."""
    make_source: Callable
    update: Callable


@dataclass(frozen=True)
class Algorithm:
    name: str
    make_scorer: ScorerFactory
    check_prompts: Callable[[Config, PromptSource], None]
    trainer_sampling: Callable[[Config], TrainerSampling | None]
    single_process: str | None


def feature_scorer(config: Config, policy: Policy) -> tuple[Scorer, Callable]:
    from driver.ebft.structured import FeatureScorer, adaptive_max_tokens

    scorer = FeatureScorer(config, policy)
    return scorer, lambda prompt: adaptive_max_tokens(len(scorer.ground_truths.token_ids(prompt)), config)


def check_ebft_prompts(config: Config, prompts: PromptSource) -> None:
    if config.ebft.ground_truth_field is not None:
        from driver.ebft.structured import check_ground_truths

        check_ground_truths(prompts, config.ebft.ground_truth_field)


def strided_sampling(config: Config) -> TrainerSampling | None:
    """EBFT's strided mode: blocks sampled by the trainer's model (driver/ebft/strided.py feeds them,
    strided_update.py trains on them)."""
    if config.ebft.mode != "strided":
        return None
    from driver.ebft.strided import StridedSource
    from driver.ebft.strided_update import optimize_strided

    return TrainerSampling(StridedSource, optimize_strided)


GRPO = Algorithm("grpo", reward_function_scorer, check_prompts=lambda config, prompts: None,
                 trainer_sampling=lambda config: None, single_process=None)
EBFT = Algorithm("ebft", feature_scorer, check_prompts=check_ebft_prompts, trainer_sampling=strided_sampling,
                 single_process="its features are scored by the trainer's model on rank 0's groups")
ALGORITHMS = {algorithm.name: algorithm for algorithm in (GRPO, EBFT)}


def algorithm(config: Config) -> Algorithm:
    return ALGORITHMS[config.algo.name]
