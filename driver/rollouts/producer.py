"""Generation jobs: one per optimizer step, each a fixed number of finished groups sampled by one
adapter version (driver/rollouts/schedule.py says which).

Partial rollouts (rollout.partial_rollout_tokens): every round generates at most that many tokens
per sample. Groups whose samples all finished leave with the job; the others stay in flight and are
continued in later jobs from their token ids (prompt + completion so far as the prompt: nothing is
detokenized and retokenized), by the newer adapter of that job, so the long tail of one batch no
longer holds up the next. Each continuation appends a Span with its version; the behaviour logprobs
stay per token, so importance sampling corrects every span against the policy that sampled it. A
group whose oldest span would be older than max_staleness when trained on is dropped (and its prompt
generated afresh under stale_policy = regenerate), and so is a finished group that waited too long.

Multi-turn episodes (driver/environments) use the same continuation: a sample whose turn ended gets its
environment's answer appended (tokens without loss) and is continued as the model's next turn in the
next round, until its episode ends; a group finishes when all its episodes have.

NeMo Gym agent episodes (environment.name: nemo_gym_agent) are played whole by the agent server's /run, one
per sample, in place of the engine's rounds (driver/rollouts/agent_runs.py).

Everything here is a pure function of (job index, version, seeds, the engine): a prefetch thread and
the synchronous loop produce the same jobs.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from driver.config import Config
from driver.data.prompts import Prompt, PromptSource
from driver.data.records import Group, Sample, Span
from driver.data.trainer_state import TrainerState
from driver.engine.base import Completion, Generator, Request
from driver.environments.episodes import EpisodeRunner
from driver.rollouts.agent_runs import AgentRuns
from driver.rollouts.schedule import staleness

IN_FLIGHT_FACTOR = 2  # partial rollouts: groups in flight at most, per group of a job's quota


@dataclass(frozen=True)
class GenerationHooks:
    """What an algorithm changes in generation (driver/algorithms.py's make_scorer gives them; None: nothing).

    max_tokens(prompt): a group's completion budget (default rollout.sampling.max_tokens; EBFT scales it
    with the length of the prompt's ground truth). extend_finished(generator, groups, version) -> metrics:
    called on each round's finished groups before on_finished, in the generation thread, to generate more
    for them with the job's adapter version (EBFT's later turns of a conversation, driver/ebft/multi_turn.py);
    its metrics are summed over the job's rounds."""
    max_tokens: Callable[[Prompt], int] | None = None
    extend_finished: Callable[[Generator, list[Group], int], dict[str, float]] | None = None


@dataclass
class Job:
    index: int
    version: int
    groups: list[Group]  # finished, in group-id order
    metrics: dict[str, float] = field(default_factory=dict)
    dropped: list[int] = field(default_factory=list)  # finished groups dropped as stale (scored for nothing)


def group_seed(seed: int, group_id: int) -> int:
    """vLLM seed of a group's first round (sample j draws with seed + j)."""
    return zlib.crc32(f"{seed}:group:{group_id}".encode()) & 0x7FFFFFFF


def continuation_seed(seed: int, group_id: int, sample_index: int, length: int) -> int:
    return zlib.crc32(f"{seed}:continue:{group_id}:{sample_index}:{length}".encode()) & 0x7FFFFFFF


class Producer:
    """Owns what generation carries from job to job: the prompt order, groups in flight (partial
    rollouts), finished groups beyond a job's quota, and prompts to generate again.

    on_finished(group) is called as soon as a group's last sample finishes (streaming scoring), or, with
    an extend_finished hook, once that hook has extended the round's finished groups; max_tokens and
    extend_finished: see GenerationHooks."""

    def __init__(self, config: Config, generator: Generator, prompts: PromptSource, tokenizer,
                 on_finished: Callable[[Group], None] | None = None,
                 max_tokens: Callable[[Prompt], int] | None = None,
                 extend_finished: Callable[[Generator, list[Group], int], dict[str, float]] | None = None,
                 episodes: EpisodeRunner | None = None, agent: AgentRuns | None = None) -> None:
        """episodes: multi-turn episodes with an environment (driver/environments/episodes.py): a sample whose
        turn ended gets the environment's answer appended and is continued in the next round. agent: episodes
        played whole by a NeMo Gym agent server instead of the engine (driver/rollouts/agent_runs.py)."""
        self.config, self.generator, self.prompts, self.tokenizer = config, generator, prompts, tokenizer
        self.on_finished, self.extend_finished, self.episodes = on_finished, extend_finished, episodes
        self.agent = agent
        self.max_tokens = max_tokens or (lambda prompt: config.rollout.sampling.max_tokens)
        self.quota = config.train.prompts_per_step * config.train.gradient_accumulation_steps
        self.budget = config.rollout.partial_rollout_tokens or config.rollout.sampling.max_tokens
        self.temperature: float | None = None  # rollout.sampling's; an evaluation sets its own
        self._job = 0  # the job being produced: the finished groups' trainer_state
        self.progress = prompts  # whose epochs_drawn() is that trainer_state's epoch (an evaluation: training's)
        self.next_group_id = 0
        self.in_flight: list[Group] = []  # unfinished groups (partial rollouts)
        self.ready: list[Group] = []  # finished groups beyond an earlier job's quota
        self.front: list[tuple[Prompt, int]] = []  # prompts to generate before new ones (re-rolls, stale)

    def produce(self, job: int, version: int, quota: int | None = None) -> Job:
        """The groups trained on at step `job` (the trainer will have taken `job` optimizer steps):
        a step's quota of them, or `quota` more for the same step (algo.dynamic_sampling's extra rounds,
        driver/rollouts/dynamic_sampling.py)."""
        quota = self.quota if quota is None else quota
        self._job = job
        started = time.perf_counter()
        metrics = {"rollout/version": float(version), "rollout/dropped_stale": 0.0,
                   "rollout/regenerated_stale": 0.0}
        finished = [g for g in self.ready if not self._stale(g, job, metrics)]
        kept = {g.group_id for g in finished}
        dropped = [g.group_id for g in self.ready if g.group_id not in kept]
        live = [g for g in self.in_flight if not self._stale(g, job, metrics)]
        if self.episodes is not None:  # the environments of episodes dropped unfinished
            self.episodes.forget({g.group_id for g in self.in_flight} - {g.group_id for g in live})
        self.in_flight = live
        self.ready = []
        rounds = continued = truncated = sampled = 0
        while len(finished) < quota:
            # Unfinished groups keep going, but new ones start beside them (up to IN_FLIGHT_FACTOR x
            # a step's quota): a long group then finishes in a later job instead of holding this one.
            room = IN_FLIGHT_FACTOR * self.quota - len(self.in_flight)
            for _ in range(min(quota - len(finished), room)):
                self.in_flight.append(self._new_group())
            done, round_continued, round_truncated, round_sampled = self._round(version, metrics)
            finished += done
            rounds, continued = rounds + 1, continued + round_continued
            truncated, sampled = truncated + round_truncated, sampled + round_sampled
        finished.sort(key=lambda group: group.group_id)
        finished, self.ready = finished[:quota], finished[quota:]
        metrics.update({"time/generation": time.perf_counter() - started, "rollout/rounds": float(rounds)})
        if self.config.rollout.partial_rollout_tokens is not None:
            metrics.update({"partial/continued_samples": float(continued),
                            "partial/truncation_rate": truncated / max(sampled, 1),
                            "partial/in_flight_groups": float(len(self.in_flight)),
                            "partial/carried_finished_groups": float(len(self.ready))})
        return Job(job, version, finished, metrics, dropped=dropped)

    def _stale(self, group: Group, job: int, metrics: dict[str, float]) -> bool:
        """Would the group be too old when trained on at step `job`? Then drop it (maybe regenerate)."""
        if not group.samples or staleness(job, group.version) <= self.config.max_staleness:
            return False
        metrics["rollout/dropped_stale"] += 1
        if self.config.rollout.stale_policy == "regenerate":
            self.front.append((group.prompt, group.attempts))
            metrics["rollout/regenerated_stale"] += 1
        return True

    def _new_group(self) -> Group:
        if self.front:
            prompt, attempts = self.front.pop(0)
        else:
            prompt, attempts = self.prompts.next_batch(1)[0], 1
        group = Group(group_id=self.next_group_id, prompt=prompt, samples=[], attempts=attempts)
        self.next_group_id += 1
        return group

    def _round(self, version: int, metrics: dict[str, float]) -> tuple[list[Group], int, int, int]:
        """One round over every group in flight; returns (groups finished, continuations, samples
        stopped by the budget, samples generated) and adds extend_finished's metrics to `metrics`."""
        if self.agent is not None:
            return self._agent_round(version)
        seed, group_size = self.config.train.seed, self.config.algo.num_generations
        requests, targets = [], []  # targets[i]: (group, sample index or None for a whole new group)
        turns = 0  # continuations that are an episode's next model turn
        for group in self.in_flight:
            max_tokens = self.max_tokens(group.prompt)
            if not group.samples:
                requests.append(Request(group.prompt.token_ids, group_size, group_seed(seed, group.group_id),
                                        min(self.budget, max_tokens), self.temperature))
                targets.append((group, None))
                continue
            for index, sample in enumerate(group.samples):
                if not sample.finished:
                    length = len(sample.token_ids)
                    # The model's next turn of an episode, or the rest of a turn the round's budget cut.
                    next_turn = self._ends_with_environment(sample)
                    turns += next_turn
                    requests.append(Request(group.prompt.token_ids + sample.token_ids, 1,
                                            continuation_seed(seed, group.group_id, index, length),
                                            min(self.budget, max_tokens - length), self.temperature))
                    targets.append((group, index))
        continued = sum(index is not None for _, index in targets) - turns
        truncated = sampled = 0
        done, finished_ids = [], set()
        for request_index, completions in self.generator.stream(requests, version):
            group, index = targets[request_index]
            max_tokens = self.max_tokens(group.prompt)
            if index is None:
                group.samples = [self._sample(c, version, max_tokens) for c in completions]
            else:
                self._extend(group.samples[index], completions[0], version, max_tokens)
            changed = group.samples if index is None else [group.samples[index]]
            sampled += len(changed)
            truncated += sum(sample.finish_reason == "partial" for sample in changed)
            if self.episodes is not None:  # ended turns: the environment answers, or the episode ends
                for sample_index in range(len(group.samples)) if index is None else [index]:
                    self.episodes.turn_ended(group, sample_index, max_tokens)
            if group.finished and group.group_id not in finished_ids:
                finished_ids.add(group.group_id)
                group.texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group.samples]
                group.trainer_state = self._trainer_state()
                done.append(group)
                if self.on_finished is not None and self.extend_finished is None:
                    self.on_finished(group)
        self.in_flight = [group for group in self.in_flight if group.group_id not in finished_ids]
        if self.extend_finished is not None and done:
            for name, value in self.extend_finished(self.generator, done, version).items():
                metrics[name] = metrics.get(name, 0.0) + value
            for group in done:
                if self.on_finished is not None:
                    self.on_finished(group)
        return done, continued, truncated, sampled

    def _agent_round(self, version: int) -> tuple[list[Group], int, int, int]:
        """NeMo Gym: every group in flight is new, and each of its samples one /run, a whole episode."""
        groups = self.in_flight
        seeds = [group_seed(self.config.train.seed, group.group_id) for group in groups]
        for group in self.agent.play(groups, version, seeds, self.config.algo.num_generations):
            # The prompt is now the one the agent's model server rendered (its tools included): logs show that one.
            group.prompt = dataclasses.replace(
                group.prompt, text=self.tokenizer.decode(group.prompt.token_ids, skip_special_tokens=False))
            group.texts = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in group.samples]
            group.trainer_state = self._trainer_state()
            if self.on_finished is not None:
                self.on_finished(group)
        self.in_flight = []
        return groups, 0, 0, sum(len(group.samples) for group in groups)

    def _trainer_state(self) -> TrainerState:
        """TRL's trainer_state for a group finishing now, in the job being produced: the optimizer updates the
        trainer will have made before training on it, and how far through the prompts generation is."""
        algo = self.config.algo
        return TrainerState(global_step=self._job * algo.num_iterations * algo.steps_per_generation,
                            max_steps=self.config.optimizer_updates, epoch=self.progress.epochs_drawn())

    @staticmethod
    def _ends_with_environment(sample: Sample) -> bool:
        spans = sample.episode.environment_spans if sample.episode is not None else []
        return bool(spans) and spans[-1][1] == len(sample.token_ids)

    def _sample(self, completion: Completion, version: int, max_tokens: int) -> Sample:
        sample = Sample([], [], "partial", [])
        self._extend(sample, completion, version, max_tokens)
        return sample

    def _extend(self, sample: Sample, completion: Completion, version: int, max_tokens: int) -> None:
        start = len(sample.token_ids)
        sample.token_ids = sample.token_ids + list(completion.token_ids)
        sample.logprobs = sample.logprobs + list(completion.logprobs)
        if len(sample.token_ids) > start or not sample.spans:  # an empty sample still has a version
            sample.spans = sample.spans + [Span(start, len(sample.token_ids), version)]
        if completion.finish_reason == "stop":
            sample.finish_reason = "stop"
        elif len(sample.token_ids) >= max_tokens:
            sample.finish_reason = "length"
        else:
            sample.finish_reason = "partial"  # stopped by the round's budget: continued later

    def state_dict(self) -> dict:
        return copy.deepcopy({"next_group_id": self.next_group_id, "in_flight": self.in_flight, "ready": self.ready,
                              "front": self.front, "data": self.prompts.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        state = copy.deepcopy(state)
        self.next_group_id, self.in_flight, self.ready = state["next_group_id"], state["in_flight"], state["ready"]
        self.front = state["front"]
        self.prompts.load_state_dict(state["data"])
