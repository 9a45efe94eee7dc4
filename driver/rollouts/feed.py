"""What feeds the trainer one RolloutBatch per step and keeps vLLM on the right adapter.

Synchronous (default): job `step` is generated when the trainer asks for it, with the adapter of
the last sync. With rollout.async_prefetch a thread (driver/rollouts/prefetch.py) generates up to
prefetch_depth jobs ahead while the trainer updates; job j is sampled by version
driver.rollouts.schedule.job_version(j) and starts only once that version is served and the trainer has
assembled job j - depth - 1 (whose failed groups it may re-roll), so a run is reproducible.

No race between a sync and an in-flight generation: every call into the engine holds
`engine_lock`, a job samples with the adapter of the version it names (LoRA engines keep the newest
few servable; the server keeps them loaded), and an engine that can hold only one set of weights
(rollout.sync = weights) gets version v only after every job sampled with an older one finished.
Rewards stream: a group is handed to the reward workers the moment its last sample finishes, so
scoring overlaps the rest of the generation (and, asynchronously, the update). algo.dynamic_sampling
generates more groups for a step while it assembles it (driver/rollouts/dynamic_sampling.py), in the
trainer's thread: synchronous only.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

from driver.cli import ConfigError
from driver.config import Config
from driver.data.prompts import PromptSource
from driver.engine import adapter_sync as sync
from driver.engine.base import Generator
from driver.policy.model import Policy
from driver.rewards.group_scorer import reward_function_scorer
from driver.rollouts.assemble import assemble
from driver.rollouts.batch import RolloutBatch
from driver.rollouts.evaluation import Evaluation, Evaluator, check_best_metric
from driver.rollouts.kl_penalty import set_kl_penalties
from driver.rollouts.prefetch import Prefetcher
from driver.environments.factory import episode_runner
from driver.rollouts.agent_runs import agent_runs
from driver.rollouts.producer import GenerationHooks, Job, Producer
from driver.rollouts.replay import ReplayBuffer
from driver.rollouts.reroll import RerollQueue, delay_steps
from driver.rollouts.schedule import job_version, sync_due, versions_kept


class Rollouts:
    def __init__(self, config: Config, policy: Policy, generator: Generator, prompts: PromptSource,
                 verifier, start_step: int, state: dict | None = None, before_first_push=None,
                 make_scorer=None, eval_prompts: dict[str, PromptSource] | None = None) -> None:
        """make_scorer(config, policy) -> (Scorer, GenerationHooks or None): the algorithm's
        (driver/algorithms.py; default: the reward functions). before_first_push(): called just
        before the start version is pushed (under torchrun the push is a collective;
        driver/rollouts/distributed_feed.py tells the other ranks it is coming). eval_prompts: the
        eval section's prompts by set (driver/rollouts/evaluation.py), None without evaluation."""
        self.config, self.policy, self.generator, self.verifier = config, policy, generator, verifier
        self.depth, self.interval = config.prefetch_depth, config.rollout.vllm_sync_interval
        if not getattr(generator, "serves_one_version", False):
            generator.keep_versions = max(generator.keep_versions, versions_kept(self.depth, self.interval))
        self.engine_lock = threading.Lock()
        self.scorer, hooks = (make_scorer or reward_function_scorer)(config, policy)
        if eval_prompts is not None:
            try:  # said now, before anything trains
                check_best_metric(config, self.scorer.names)
            except ConfigError:
                self.scorer.close()
                raise
        hooks = hooks or GenerationHooks()
        self.replay = (ReplayBuffer(config.algo.replay_buffer_size, config.algo.replay_max_age,
                                    config.algo.replay_sampling, config.train.seed)
                       if config.algo.replay_buffer_size else None)
        algo = config.algo
        self.reroll = (RerollQueue(max(delay_steps(algo.reroll_after, config.train.steps), self.depth + 1),
                                   algo.reroll_max_attempts, algo.reroll_queue_size,
                                   start_step=int(algo.reroll_start_fraction * config.train.steps),
                                   per_step=algo.reroll_max_groups)
                       if algo.reroll_failed else None)
        self._reroll_lock = threading.Lock()
        self.kl_penalty = (functools.partial(set_kl_penalties, config, policy) if config.algo.kl_in_reward
                           else None)
        # Rewards in worker processes can start the moment a group finishes, in any thread; rewards in
        # this process must run in the main thread (signal.alarm), so only the synchronous loop streams them.
        self.stream_rewards = self.scorer.in_workers or self.depth == 0
        self.agent = agent_runs(config, generator)  # NeMo Gym's /run (started with ng_run when configured)
        self.producer = Producer(config, generator, prompts, policy.tokenizer,
                                 on_finished=self.scorer.submit_group if self.stream_rewards else None,
                                 max_tokens=hooks.max_tokens, extend_finished=hooks.extend_finished,
                                 episodes=episode_runner(config, policy.tokenizer), agent=self.agent)
        self.evaluator = (Evaluator(config, generator, eval_prompts, policy.tokenizer, self.scorer, self.agent,
                                    training=prompts) if eval_prompts is not None else None)
        # Checkpoints under prefetch: the producer's state before each job not assembled yet, and the
        # re-rolled prompts each took from the queue (both under _state_lock).
        self._state_lock = threading.Lock()
        self._snapshots: dict[int, dict] = {}
        self._taken: dict[int, list] = {}
        if state is not None:
            self._load_state_dict(state)
        self.start_step = start_step
        self.served = -1  # newest version pushed to the engine
        self.assembled = start_step  # jobs 0 .. assembled - 1 are assembled (or belong to the resumed past)
        self.prefetcher = None
        if before_first_push is not None:
            before_first_push()
        self.push(start_step, force=True)
        if self.depth:
            self.prefetcher = Prefetcher(self._produce, start_step, self._may_start)

    # -- generation side (the prefetch thread, or the trainer's thread when synchronous) --

    def _version(self, job: int) -> int:
        # After a resume at step s only version s exists: jobs that would have used an older one use it.
        return max(job_version(job, self.depth, self.interval), self.start_step)

    def _may_start(self, job: int) -> bool:  # read under the prefetcher's condition
        return self.served >= self._version(job) and self.assembled >= job - self.depth

    def _produce(self, job: int) -> Job:
        """Job `job`; the producer's state before it is kept for a checkpoint until the job is assembled."""
        with self._state_lock:
            taken = []
            if self.reroll is not None:
                with self._reroll_lock:
                    taken = self.reroll.due(job, self.producer.quota)
            self.producer.front[:0] = taken
            self._taken[job], self._snapshots[job] = taken, self.producer.state_dict()
        with self.engine_lock:
            return self.producer.produce(job, self._version(job))

    def _produce_more(self, job: int, count: int) -> Job:
        """algo.dynamic_sampling: `count` more groups for job `job` (synchronous loop only: no job is in
        flight, and the snapshot taken before the job still covers every prompt they take)."""
        with self.engine_lock:
            return self.producer.produce(job, self._version(job), quota=count)

    # -- the trainer's side --

    def next_batch(self, step: int, abandon=lambda: False) -> RolloutBatch | None:
        """The batch of optimizer step step + 1; None when `abandon()` turned true while waiting."""
        started = time.perf_counter()
        if self.prefetcher is None:
            job = self._produce(step)
        else:
            job = self.prefetcher.get(step, abandon)
            if job is None:
                return None
        waited = time.perf_counter() - started
        produce_more = functools.partial(self._produce_more, step) if self.config.algo.dynamic_sampling else None
        with self._reroll_lock:
            batch = assemble(self.config, job, step, self.scorer, not self.stream_rewards, self.replay, self.reroll,
                             self.kl_penalty, produce_more)
        batch.metrics["time/queue_wait"] = waited
        self._publish(assembled=step + 1)
        with self._state_lock:
            for old in [j for j in self._snapshots if j <= step]:
                del self._snapshots[old], self._taken[old]
        return batch

    def evaluate(self, step: int) -> Evaluation | None:
        """The eval section's evaluation of the adapter the engine serves after `step` steps (the step's own:
        eval.steps is a multiple of the sync interval); None without one."""
        if self.evaluator is None:
            return None
        return self.evaluator.evaluate(self.served, self.engine_lock)

    def push(self, step: int, force: bool = False) -> dict[str, float]:
        """After `step` optimizer steps: save the adapter and make the engine serve it, when due."""
        if not (force or sync_due(step, self.interval)):
            return {}
        if self.prefetcher is not None and getattr(self.generator, "serves_one_version", False):
            # One set of weights: every job sampled with an older version must be done first.
            self.prefetcher.wait_produced(step + self.depth)
        with self.engine_lock:
            metrics = sync.push_adapter(self.config, self.policy, self.generator, self.verifier, version=step,
                                        keep=self.generator.keep_versions)
        self._publish(served=step)
        return metrics

    def _publish(self, served: int | None = None, assembled: int | None = None) -> None:
        """Advance what the prefetch thread's start condition reads, and wake it."""
        with self.prefetcher.condition if self.prefetcher is not None else contextlib.nullcontext():
            if served is not None:
                self.served = served
            if assembled is not None:
                self.assembled = assembled
        if self.prefetcher is not None:
            self.prefetcher.notify()

    def state_dict(self) -> dict:
        """What a checkpoint after the last assembled step needs to continue without losing a prompt:
        the generation state before the oldest job not trained on yet (with the re-rolled prompts that
        later jobs already took), and the re-roll and replay queues."""
        with self._state_lock:
            oldest = self.assembled
            if oldest in self._snapshots:
                snapshot = self._snapshots[oldest]
                taken_later = [item for job in sorted(self._taken) if job > oldest for item in self._taken[job]]
                producer = {**snapshot, "front": snapshot["front"] + taken_later}
            else:  # no job started beyond the trainer: the producer is idle
                producer = self.producer.state_dict()
        state = {"producer": producer}
        if self.reroll is not None:
            with self._reroll_lock:
                state["reroll"] = self.reroll.state_dict()
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def _load_state_dict(self, state: dict) -> None:
        self.producer.load_state_dict(state["producer"])
        if self.reroll is not None and "reroll" in state:
            self.reroll.load_state_dict(state["reroll"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.stop()
            self.prefetcher = None
        self.scorer.close()
        if self.agent is not None:
            self.agent.close()
