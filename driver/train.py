"""GRPO or EBFT with LoRA / QLoRA against vLLM: `python -m driver.train cfg.yaml [--section.key=value ...]`.

One step: prompts -> vLLM samples num_generations completions each (with their logprobs) ->
rewards -> group advantages (DeepSeekMath GRPO, https://arxiv.org/abs/2402.03300) -> clipped,
importance-corrected loss on packed sequences -> optimizer update(s) -> adapter sync to vLLM,
verified with a logprob probe. driver/rollouts/feed.py feeds the batches: synchronously, or generated
ahead in a thread (rollout.async_prefetch), with partial rollouts, reward workers, zero-advantage
filtering, replay and re-rolls. EBFT (algo.name: ebft, https://arxiv.org/abs/2603.12248) replaces the
rewards by feature matching against a ground truth (driver/ebft/); its strided mode samples blocks
in the trainer instead of vLLM (driver/algorithms.py gives that mode's batch source and update).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

import torch
import yaml
from rich.console import Console

import pykernels.backend
from driver.algorithms import algorithm
from driver.checkpoint import CHECKPOINTS, BestAdapter, find_checkpoint, load_checkpoint, save_checkpoint
from driver.cli import ConfigError, config_from_argv, exit_on_config_error
from driver.config import Config, eval_prefix, is_hub_id
from driver.data.model_source import model_directory
from driver.data.adapter_settings import adopt_adapter_settings
from driver.data.eval_prompts import training_and_eval_prompts
from driver.data.hub_upload import (HubUploader, HubUploadError, Upload, checkpoint_folder, create_repository,
                                    trained_upload, upload_commands)
from driver.distributed import world as distributed
from driver.distributed.fsdp import reshard_before_steps, shard_policy
from driver.engine import RolloutError, make_generator
from driver.engine import adapter_sync as sync
from driver.engine.colocate import set_cpu_defaults
from driver.engine.launch import LOG_NAME as SERVER_LOG
from driver.environments.factory import prompt_tools
from driver.interrupt import GracefulInterrupt
from driver.metrics import memory
from driver.metrics.console import LOG_FILE, Terminal, library_output_to_file
from driver.metrics.logger import MetricsLogger
from driver.metrics.plots import plot_metrics
from driver.metrics.startup import StartupPhases, describe
from driver.metrics.summary import evaluation_summary, run_summary
from driver.metrics.trackers import open_trackers
from driver.policy.model import kernel_modes, load_policy
from driver.rewards.functions import RewardError
from driver.rollouts.distributed_feed import FollowerFeed, LeaderFeed, on_rank0
from driver.rollouts.feed import Rollouts
from driver.rollouts.source import BatchSource
from driver.update.entropy_control import controller as entropy_controller
from driver.update.loss_scale import LossScaleError, start_loss_scale
from driver.update.optim import build_optimizer, build_scheduler
from driver.update.step import optimize

INTERRUPTED_EXIT_CODE = 130  # the shell's convention for a run stopped by SIGINT (128 + the signal's number)


def run(config: Config) -> int | None:
    """Train; returns None when the run ended, else the signal that stopped it early (Ctrl-C's SIGINT or SIGTERM,
    after saving a checkpoint). Under torchrun every rank runs this: rank 0 generates, logs and talks to vLLM; all
    ranks train their shard."""
    run_started = time.perf_counter()
    world = distributed.init_world()
    check_world(config, world)
    adopt_adapter_settings(config)  # lora.init_from's r, alpha, targets: in config.yaml and all that follows
    output_dir = config.output_dir
    if config.eval.only:
        if (output_dir / CHECKPOINTS).is_dir():  # its config.yaml and metrics would be replaced by the evaluation's
            raise ConfigError(f"eval.only: logging.output_dir {output_dir} holds a training run; evaluate into "
                              "another directory (its checkpoints load from there: checkpoint.resume=<path>)")
        config.rollout.async_prefetch = False  # nothing trains: no batch generated ahead for a step that never comes
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        if world.is_main:
            write_resolved_config(config)
    except OSError as error:  # before anything loads: a mistyped or read-only path is a config mistake
        raise ConfigError(f"logging.output_dir: cannot write {output_dir} ({error.strerror or error})") from None
    with library_output_to_file(output_dir / log_name(world), config.logging.quiet) as terminal:
        return train(config, world, terminal, run_started)


def write_resolved_config(config: Config) -> None:
    """output_dir/config.yaml: what runs (a resume or `continue` reads it back)."""
    (config.output_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def steps_from_epochs(config: Config, world: distributed.World, prompts, startup: StartupPhases) -> None:
    """train.epochs decides train.steps once the prompts are counted (on rank 0, told to every rank)."""
    given = config.train.steps if "steps" in config.train.model_fields_set else None
    steps = distributed.broadcast(config.train.steps_for_epochs(len(prompts.prompts)) if world.is_main else None)
    config.train.steps = steps
    if world.is_main:
        write_resolved_config(config)
    replaced = f" (in place of train.steps = {given})" if given not in (None, steps) else ""
    startup.print(f"train.epochs = {config.train.epochs:g}: {steps} steps of "
                  f"{config.train.prompts_per_step * config.train.gradient_accumulation_steps} prompts{replaced}")


def log_name(world: distributed.World) -> str:
    return LOG_FILE if world.is_main else f"run-rank{world.rank}.log"


def train(config: Config, world: distributed.World, terminal: Terminal, run_started: float) -> int | None:
    output_dir = config.output_dir
    torch.manual_seed(config.train.seed)
    pykernels.backend.set_kernels(**kernel_modes(config))
    algo = algorithm(config)
    console = Console(file=terminal.out)
    startup = StartupPhases(console if world.is_main else None,
                            spinner=config.logging.progress and terminal.log_path is not None)
    if terminal.log_path is not None:  # first: where to look while the model loads and vLLM starts
        startup.print(f"vLLM's and the libraries' output: {terminal.log_path}")

    hub = open_hub(config, world, startup)  # first: a token or repository problem stops the run before it loads
    if is_hub_id(config.model.path):  # its own phase: the first run downloads the weights
        with startup.phase(f"fetching {config.model.path} from the Hugging Face Hub",
                           lambda: f"fetched {config.model.path} ({snapshot})"):
            snapshot = model_directory(config.model.path, config.model.revision)  # load_policy's, cached
    started_from = f" with the adapter {config.lora.init_from}" if config.lora.init_from else ""
    with startup.phase(f"loading {config.model.path}{started_from}",
                       lambda: f"loaded {config.model.path}{started_from} ({describe(policy)})"):
        policy = load_policy(config)
        if world.distributed:
            shard_policy(policy, config.train.master_weights)  # before the optimizer: FSDP replaces the parameters
    startup.print(f"pykernels: {policy.kernels}" + (f"; {world.size} ranks (FSDP2)" if world.distributed else ""))
    prompts = eval_prompts = None
    if world.is_main:
        with startup.phase(f"reading the prompts ({config.data.source})",
                           lambda: f"read {len(prompts.prompts)} prompts ({config.data.source})"
                           + (evaluated_from(config, eval_prompts) if eval_prompts is not None else "")):
            prompts, eval_prompts = training_and_eval_prompts(config, policy.tokenizer,
                                                              tools=prompt_tools(config, policy.tokenizer))
            algo.check_prompts(config, prompts)
    if config.train.epochs is not None:
        steps_from_epochs(config, world, prompts, startup)
    optimizer = build_optimizer(policy.trainable_parameters(), config.train, model=policy.model)
    if world.distributed:
        reshard_before_steps(optimizer, policy.model)
    if config.algo.use_adaptive_entropy:  # its state's keys before a resume: torchrun's sharded load fills those it has
        entropy_controller(config.algo, optimizer)
    start_loss_scale(config, optimizer)  # float16's, the same way
    scheduler = build_scheduler(optimizer, config.train, config.optimizer_updates)
    step, rollout_state = 0, None
    first_step = 0
    if config.checkpoint.resume:
        try:  # a missing checkpoint, or one another config wrote: the user's to fix, said in one line
            # rank 0's (with auto the ranks must agree whether there is one)
            checkpoint = distributed.broadcast(find_checkpoint(output_dir, config.checkpoint.resume)
                                               if world.is_main else None)
            if checkpoint is None:
                startup.print(f"checkpoint.resume: auto: no checkpoint in {output_dir / CHECKPOINTS}, starting at "
                              "step 0")
            else:
                with startup.phase(f"resuming from {checkpoint}",
                                   lambda: f"resumed at step {step} from {checkpoint}"):
                    step, rollout_state = load_checkpoint(checkpoint, policy, optimizer, scheduler, prompts)
        except (FileNotFoundError, ValueError) as error:  # chained: run.log keeps where it came from
            raise ConfigError(str(error)) from error
        first_step = step
        if step >= config.train.steps and not config.eval.only:  # before the engine starts: nothing to generate for
            startup.print(f"the run is complete (step {step}, train.steps = {config.train.steps}): nothing to train; "
                          "raise train.steps to train on")
            return None

    sampling = algo.trainer_sampling(config)  # the trainer samples: no inference engine
    generator = None
    if not sampling:
        with engine_phase(startup, config):
            generator = on_rank0(lambda: make_generator(config, policy), "start vLLM")
    verifier = None if sampling else sync.make_verifier(config, policy)
    update = sampling.update if sampling else partial(optimize, term=algo.ground_truth_loss(config))
    steps = 0 if config.eval.only else config.train.steps
    logger = (MetricsLogger(output_dir, total_steps=config.train.steps, start_step=step,
                            tensorboard=config.logging.tensorboard, progress=config.logging.progress and steps > 0,
                            console=console,
                            trackers=open_trackers(config.logging.report_to, output_dir, config.logging.project,
                                                   config.logging.run_name, config.model_dump(mode="json"),
                                                   resume=step > 0))
              if world.is_main else SilentLogger())
    rollouts: BatchSource | None = None
    final_checkpoint: Path | None = None
    best: BestAdapter | None = None
    try:
        if sampling:
            rollouts = sampling.make_source(config, policy, prompts, rollout_state)
        elif not world.distributed:
            rollouts = Rollouts(config, policy, generator, prompts, verifier, step, rollout_state,
                                make_scorer=algo.make_scorer, eval_prompts=eval_prompts)
        elif world.is_main:
            rollouts = LeaderFeed(lambda ready: Rollouts(config, policy, generator, prompts, verifier, step,
                                                         rollout_state, before_first_push=ready,
                                                         make_scorer=algo.make_scorer, eval_prompts=eval_prompts))
        else:
            rollouts = FollowerFeed(config, policy)
        best = (BestAdapter(output_dir, config.eval.best_key(), config.eval.greater_is_better)
                if config.eval.save_best else None)
        if config.eval.on_start or config.eval.only:
            log_evaluation(logger, step, rollouts.evaluate(step), config.eval.labels(), best, policy)
        with GracefulInterrupt(out=terminal.out) as interrupt:
            # Under torchrun rank 0 alone decides to stop (its next_batch tells the others).
            while step < steps and (world.distributed or not interrupt.requested):
                started = time.perf_counter()
                try:
                    batch = rollouts.next_batch(step, abandon=lambda: interrupt.requested)
                except Exception:
                    if not interrupt.requested or world.distributed:
                        raise
                    batch = None  # abandoned step: its prompts come first on resume
                if batch is None:
                    break
                generated = time.perf_counter()
                memory.reset_peak(policy.device)
                metrics = {**batch.metrics, **update(config, policy, batch, optimizer, scheduler)}
                updated = time.perf_counter()
                if (peak := memory.peak_gib(policy.device)) is not None:
                    metrics["memory/update_peak_gib"] = peak
                step += 1
                metrics.update(rollouts.push(step))
                metrics.update({"time/batch": generated - started, "time/update": updated - generated,
                                "time/step": time.perf_counter() - started})
                logger.log(step, metrics)
                if step % config.logging.log_completions_every == 0:
                    show_samples(logger, batch, config.logging.log_completions)
                    logger.log_completions(step, batch.table)
                if config.eval.steps and step % config.eval.steps == 0:
                    log_evaluation(logger, step, rollouts.evaluate(step), config.eval.labels(), best, policy)
                if config.checkpoint.every and step % config.checkpoint.every == 0:
                    saved = save_checkpoint(output_dir, step, policy, optimizer, scheduler, prompts,
                                            config.checkpoint.keep, rollouts.state_dict())
                    if hub is not None and hub.each_save:
                        hub.push(trained_upload(config, hub.repo_id, saved / policy.trained_name, step,
                                                checkpoint=saved))
        if steps:
            final_checkpoint = save_checkpoint(output_dir, step, policy, optimizer, scheduler, prompts,
                                               config.checkpoint.keep, rollouts.state_dict())
            policy.save_trained(output_dir / policy.trained_name)
        interrupted = step < steps
    finally:
        if rollouts is not None:
            rollouts.close()  # first: its thread must not hold the engine when the engine shuts down
        logger.close()
        if generator is not None:
            generator.close()
    if config.logging.plots and world.is_main and steps:
        plot_metrics(output_dir / "metrics.jsonl", output_dir)
    hub_failures = push_final(hub, config, policy, best, step, interrupted, step > first_step, terminal.out,
                              final_checkpoint)
    if world.is_main and not steps:
        print(evaluation_summary(output_dir, wall_seconds=time.perf_counter() - run_started,
                                 quiet=terminal.log_path is not None), file=terminal.out)
    elif world.is_main and step > first_step:
        print(run_summary(output_dir, steps_done=step, steps_planned=config.train.steps,
                          wall_seconds=time.perf_counter() - run_started, quiet=terminal.log_path is not None,
                          plots=config.logging.plots, tensorboard=config.logging.tensorboard,
                          best=(best.directory, best.best) if best is not None and best.best else None,
                          epochs=config.train.epochs,
                          hub=hub.url if hub is not None and hub.uploaded and not interrupted else None),
              file=terminal.out)
    if hub_failures:  # last: everything is on disk and summarized
        # the final upload's folders, else (a background upload failed) the trained adapter's
        unsent = hub.unsent.folders if hub.unsent else {"": output_dir / policy.trained_name}
        raise HubUploadError(f"uploading to {hub.url} failed ({'; '.join(hub_failures)}); everything is in "
                             f"{output_dir}: upload it with {upload_commands(hub.repo_id, unsent)}")
    # A rank of torchrun's that received no signal itself stops with the others, said as Ctrl-C's.
    return (interrupt.signal or signal.SIGINT) if interrupted else None


def engine_phase(startup: StartupPhases, config: Config) -> contextlib.AbstractContextManager:
    """The startup phase that starts the generation engine; none for transformers' generate (nothing starts)."""
    rollout = config.rollout
    if rollout.backend == "transformers":
        return contextlib.nullcontext()
    if rollout.backend == "colocate":
        return startup.phase("starting vLLM in this process", "started vLLM")
    if rollout.server_url:
        urls = ", ".join(rollout.server_url if isinstance(rollout.server_url, list) else [rollout.server_url])
        return startup.phase(f"connecting to vLLM at {urls}", f"connected to vLLM at {urls}")
    startup.print(f"the vLLM server's output: {config.output_dir / SERVER_LOG}")
    return startup.phase("launching a vLLM server", "launched a vLLM server")


def open_hub(config: Config, world: distributed.World, startup: StartupPhases) -> HubUploader | None:
    """checkpoint.push_to_hub: rank 0 finds or creates the repository (driver/data/hub_upload.py)."""
    checkpoint = config.checkpoint
    if not (checkpoint.push_to_hub and world.is_main):
        return None
    when = {"end": "at the end", "every_save": "each checkpoint and the end",
            "checkpoint": "each checkpoint, the checkpoint itself in last-checkpoint/, and the end",
            "all_checkpoints": "each checkpoint, the checkpoint itself in checkpoints/, and the end"}[
        checkpoint.hub_strategy]
    with startup.phase("finding or creating the Hugging Face Hub repository",
                       lambda: f"will upload to {hub.url} ({when})"):
        hub = HubUploader(create_repository(checkpoint, config.output_dir), config.output_dir,
                          each_save=checkpoint.hub_strategy != "end")
    return hub


def push_final(hub: HubUploader | None, config: Config, policy, best: BestAdapter | None, step: int,
               interrupted: bool, trained: bool, out, checkpoint: Path | None = None) -> list[str]:
    """The end of push_to_hub: the background upload waited for, then the final adapter (with eval.save_best's in
    best/, and the final checkpoint with hub_strategy checkpoint or all_checkpoints) uploaded when this run trained
    to its last step (stopped early, under those two strategies, its checkpoint alone), said on the terminal;
    what failed, a line each."""
    if hub is None:
        return []
    upload = None
    folder = checkpoint_folder(config, checkpoint) if trained else {}
    if interrupted and folder:  # the checkpoint it stopped with, for a resume elsewhere; not the root's adapter
        upload = Upload(folder, f"checkpoint after step {step} (stopped early)")
        print(f"uploading the checkpoint to {hub.url} (the run stopped early: the {policy.trained_name} goes up at "
              "its end) ...", file=out, flush=True)
    elif interrupted:
        print(f"not uploaded to {hub.url}: the run stopped early (continued to its end, it uploads)", file=out)
    elif trained:
        upload = trained_upload(config, hub.repo_id, config.output_dir / policy.trained_name, step,
                                best.directory if best is not None and best.best else None, checkpoint)
        print(f"uploading the {policy.trained_name} to {hub.url} ...", file=out, flush=True)
    failures = hub.finish(upload)
    if hub.uploaded:
        print(f"uploaded to {hub.url}", file=out)
    return failures


def check_world(config: Config, world: distributed.World) -> None:
    """What a torchrun launch cannot do yet, said before anything starts."""
    if not world.distributed:
        return
    if config.rollout.backend == "transformers" and algorithm(config).trainer_sampling(config) is None:
        raise ConfigError("rollout.backend = transformers: under torchrun the model is sharded, and generation with "
                          "it would be forwards only rank 0 runs; use vLLM (rollout.backend: colocate, on rank 0's "
                          "GPU, or server)")


def evaluated_from(config: Config, eval_prompts: dict) -> str:
    """The start-up line's end: which prompts the evaluations take."""
    evaluation = config.eval
    if evaluation.val_set_size:
        return f" and held out {len(eval_prompts[''].prompts)} for evaluation"
    described = []
    for label, prompts in eval_prompts.items():
        data = evaluation.data(config.data, label)
        split = f", {data.split}" if data.source_kind() in ("hub", "directory") else ""
        described.append(f"{len(prompts.prompts)} to evaluate ({f'{label}: ' if label else ''}{data.source}{split})")
    return " and " + ", ".join(described)


def log_evaluation(logger, step: int, evaluation, labels: list[str], best: BestAdapter | None = None,
                   policy=None) -> None:
    """An Evaluation (driver/rollouts/evaluation.py) into the logs, and a line above the progress bar; with
    eval.save_best the adapter goes to output_dir/best when it is the best so far (on every rank: collective)."""
    if evaluation is None:
        return
    logger.log_eval(step, evaluation.metrics, evaluation.table)
    metrics = evaluation.metrics
    parts, failed = [], 0
    for label in labels:  # each set's: eval/ for the one set, eval_<set>/ for eval.sets
        prefix = eval_prefix(label)
        reward = metrics.get(prefix + "reward")
        parts.append(f"{label + ' ' if label else ''}reward {'n/a' if reward is None else f'{reward:.3f}'} over "
                     f"{int(metrics[prefix + 'prompts'])} prompts in {metrics[prefix + 'time']:.1f} s")
        failed += int(metrics[prefix + "failed_groups"])
    line = f"eval after step {step}: " + "; ".join(parts)
    if evaluation.failure is not None:  # its first line (which reward, how) and last (on what input): no traceback
        lines = evaluation.failure.splitlines()
        what = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        line += f"; {failed} group(s) could not be scored (first: {what})"
    if best is not None and best.consider(step, metrics, policy):
        line += f"; best so far: saved to {best.directory}"
    logger.print(line)


class SilentLogger:
    """Ranks other than 0 log nothing (rank 0 logs the step's metrics, reduced over the ranks)."""

    def log(self, step: int, metrics: dict) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def log_completions(self, step: int, rows: list[dict]) -> None:
        pass

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def show_samples(logger: MetricsLogger, batch, count: int) -> None:
    from rich.markup import escape

    for prompt, completion, reward in batch.samples[:count]:
        logger.print(f"[dim]{escape(repr(prompt))}[/dim] -> {escape(repr(completion))}  reward {reward:.3f}")


def main(argv: list[str] | None = None) -> int:
    # Before the config names (and so imports) the reward modules: a module importing trl sets
    # VLLM_LOGGING_LEVEL=ERROR when unset (trl/_compat.py), and the engine, or a server launched from here,
    # would then hide its warnings instead of showing them at the driver's level.
    set_cpu_defaults()
    try:
        config = config_from_argv(sys.argv[1:] if argv is None else argv)
    except ConfigError as error:
        exit_on_config_error(error)
    if config is None:
        return 0
    previous = signal.signal(signal.SIGTERM, stop_as_ctrl_c)
    try:
        stopped_by = run(config)
        return 0 if stopped_by is None else 128 + stopped_by
    except ConfigError as error:  # found once the data is read (a missing column, a rejected row)
        exit_on_config_error(error)
    except (RolloutError, RewardError, HubUploadError, LossScaleError) as error:  # the run's failures, not bugs
        details = f" (details: {config.output_dir / LOG_FILE})" if config.logging.quiet else ""
        print(f"error: {error}{details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the first step (while loading or starting vLLM), or a second one
        print("\ninterrupted: stopped without saving a checkpoint", file=sys.stderr)
        # Not the os._exit below: the interpreter's exit runs vLLM's handlers that stop a half-started engine.
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_as_ctrl_c(_signum, _frame) -> None:
    """SIGTERM outside the training loop (loading, starting vLLM; GracefulInterrupt's own handler within it): stop
    as Ctrl-C stops, rather than die at once without vLLM's exit handlers."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    code = main()
    # Interpreter teardown after a finished run has aborted once in ~15 runs here ("terminate called
    # without an active exception", exit 134: a C++ thread of vLLM or torch destroyed while still
    # joinable). The engine is shut down and every output is written and closed by now: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
