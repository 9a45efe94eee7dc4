"""What generation produces, before it becomes a training batch: groups of samples whose tokens
remember which adapter version sampled them.

A sample can be generated in several rounds (partial rollouts): each round appends a span of
tokens sampled by one version. Its staleness is measured from its OLDEST span, the one furthest
from the policy it is trained into (verl's param_version_start; TRL stamps the version at request
start, which is the same thing without partial rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from driver.data.prompts import Prompt
from driver.data.trainer_state import TrainerState

FINISHED = ("stop", "length")  # "partial": stopped by the round's token budget, to be continued


@dataclass(frozen=True)
class Span:
    start: int  # first token of the span in the completion
    end: int  # one past its last token
    version: int  # adapter version (optimizer steps) that sampled these tokens


@dataclass
class Episode:
    """A multi-turn sample's conversation with its environment (driver/environments): the sample's token ids
    hold the model's turns and, between them, the environment's messages rendered with the chat template,
    whose tokens carry no loss and no importance weight."""

    messages: list[dict] = field(default_factory=list)  # after the prompt: assistant turns and environment messages
    environment_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of environment tokens
    turns: int = 0  # model turns so far
    tool_calls: int = 0
    tool_failures: int = 0  # tool calls that raised, named no known tool, or could not be parsed
    done: bool = False  # the environment ended the episode (else it was capped, or is still running)
    reward: float | None = None  # the environment's reward when it gives one (driver.environments.environment_reward)
    # NeMo Gym /run: a later model call's prompt did not extend the sequence (a template re-rendering earlier
    # turns), so the episode was cut at the last consistent turn (driver/environments/nemo_gym_episode.py)
    prefix_mismatch: bool = False


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # the engine's sampling logprobs, one per token (behaviour policy)
    finish_reason: str  # "stop", "length" or "partial"
    spans: list[Span] = field(default_factory=list)
    # EBFT multi-turn: the assistant turns generated after the data's later user turns, in order, never
    # trained (driver/ebft/multi_turn.py). A class default, so samples of older checkpoints read ().
    later_turns: tuple[str, ...] = ()
    # A multi-turn episode with an environment (None: one completion). A class default, as later_turns.
    episode: Episode | None = None

    @property
    def version(self) -> int:
        """The oldest version that sampled any of its tokens (an empty sample: -1 for none)."""
        return min((span.version for span in self.spans), default=-1)

    @property
    def finished(self) -> bool:
        return self.finish_reason in FINISHED


@dataclass
class Group:
    """The num_generations samples of one prompt, and what scoring learned about them."""

    group_id: int  # unique in a run, in generation order
    prompt: Prompt
    samples: list[Sample]
    attempts: int = 1  # how many times this prompt has been rolled (deferred re-roll counts up)
    rewards: torch.Tensor | None = None  # [G, F] per reward function, NaN where one returned None
    failure: str | None = None  # why scoring failed after its retry (the failing reward and input)
    total: torch.Tensor | None = None  # [G] weighted reward, set when the step's batch is assembled
    advantages: torch.Tensor | None = None  # [G], set when the step's batch is assembled
    kl_penalty: torch.Tensor | None = None  # [G] algo.kl_in_reward: -beta x summed KL, set at assembly
    replayed: bool = False  # taken from the replay buffer rather than generated for this step
    texts: list[str] | None = None  # the decoded completions (rewards and logs read them)
    trainer_state: TrainerState = TrainerState()  # progress when it finished: the rewards' trainer_state

    @property
    def version(self) -> int:
        return min(sample.version for sample in self.samples)

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)
