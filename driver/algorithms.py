"""The training algorithms, registered once and dispatched once: what GRPO and EBFT do differently.

Everything else (the loop, generation, filtering, replay, re-rolls, checkpoints) is shared, and asks
the run's `algorithm(config)`, never the name:
  make_scorer(config, policy)   -> (Scorer, GenerationHooks or None): what scores the groups and
                                   turns their rewards into advantages (driver/rewards/scorer.py), and
                                   what the algorithm changes in generation (driver/rollouts/producer.py:
                                   each group's completion budget, more generated for finished groups)
  check_prompts(config, prompts)   dataset checks made before the first step
  trainer_sampling(config)      -> TrainerSampling (the batch source and the update of a mode in which
                                   the trainer samples its own rollouts, no inference engine: EBFT's
                                   strided mode), or None: vLLM generates, driver/update/step.py trains
  ground_truth_loss(config)     -> GroundTruthLoss: the policy loss's weight and a cross-entropy term on
                                   each prompt's ground truth (driver/update/ground_truth_loss.py), or
                                   None: the policy loss alone
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from driver.config import Config
from driver.data.prompts import PromptSource
from driver.policy.model import Policy
from driver.rewards.group_scorer import reward_function_scorer
from driver.rewards.scorer import Scorer
from driver.rollouts.producer import GenerationHooks
from driver.update.ground_truth_loss import GroundTruthLoss

ScorerFactory = Callable[[Config, Policy], tuple[Scorer, GenerationHooks | None]]


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
    ground_truth_loss: Callable[[Config], GroundTruthLoss | None] = lambda config: None


def feature_scorer(config: Config, policy: Policy) -> tuple[Scorer, GenerationHooks]:
    from driver.ebft.structured import FeatureScorer, generation_hooks

    scorer = FeatureScorer(config, policy)
    return scorer, generation_hooks(config, scorer)


def check_ebft_prompts(config: Config, prompts: PromptSource) -> None:
    if config.ebft.ground_truth_field is not None:
        from driver.ebft.structured import check_ground_truths

        check_ground_truths(prompts, config.ebft.ground_truth_field)
    from driver.ebft.multi_turn import check_multi_turn_rows

    check_multi_turn_rows(config, prompts)


def strided_sampling(config: Config) -> TrainerSampling | None:
    """EBFT's strided mode: blocks sampled by the trainer's model (driver/ebft/strided.py feeds them,
    strided_update.py trains on them)."""
    if config.ebft.mode != "strided":
        return None
    from driver.ebft.strided import StridedSource
    from driver.ebft.strided_update import optimize_strided

    return TrainerSampling(StridedSource, optimize_strided)


def ebft_ground_truth_loss(config: Config) -> GroundTruthLoss:
    """Structured mode (strided trains with its own update): rl_coef x the GRPO loss + ce_coef x the
    cross-entropy on the ground truth, as strided mode's."""
    return GroundTruthLoss(policy_coef=config.ebft.rl_coef, ce_coef=config.ebft.ce_coef, metric_prefix="ebft/")


GRPO = Algorithm("grpo", reward_function_scorer, check_prompts=lambda config, prompts: None,
                 trainer_sampling=lambda config: None)
EBFT = Algorithm("ebft", feature_scorer, check_prompts=check_ebft_prompts, trainer_sampling=strided_sampling,
                 ground_truth_loss=ebft_ground_truth_loss)
ALGORITHMS = {algorithm.name: algorithm for algorithm in (GRPO, EBFT)}


def algorithm(config: Config) -> Algorithm:
    return ALGORITHMS[config.algo.name]
