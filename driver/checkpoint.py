"""Checkpoints: everything needed to continue a run bit for bit.

output_dir/checkpoints/step-000012/
    adapter/               PEFT format (adapter_config.json, adapter_model.safetensors), or under full
                           fine-tuning model/ (config.json, model.safetensors)
    trainer_state.pt       optimizer, scheduler, RNG states, data position, step, and the rollout state
                           (groups in flight, re-roll and replay queues: driver/rollouts/feed.py)
    optimizer/             under torchrun: the sharded optimizer state (torch.distributed.checkpoint,
                           one file per rank; loads at any world size, one process included), instead of
                           trainer_state.pt's; under full fine-tuning the weights' shards too (fp32 master
                           weights: model/ is 16-bit)
    reference.safetensors  with algo.sync_ref_model: the KL reference, which no longer is the base
Written to a temporary directory and renamed, so a crash never leaves half a checkpoint.

With eval.save_best, output_dir/best/ holds the adapter (or model) of the best evaluation so far, and
best.json its step and metric: a directory PeftModel.from_pretrained and lora.init_from load as it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import random
import shutil
import types
from pathlib import Path

import numpy as np
import torch

from driver.distributed import world as distributed
from driver.distributed.no_decay_group import split_saved_group

STATE_FILE = "trainer_state.pt"
REFERENCE_FILE = "reference.safetensors"  # algo.sync_ref_model's moved KL reference

# The rollout state pickles prompts and sample groups (partial rollouts in flight, re-rolls);
# checkpoints written before the driver's packages name their classes by the old modules, and
# still resume.
MOVED_MODULES = {"driver.data": "driver.data.prompts", "driver.rollout.records": "driver.data.records"}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return super().find_class(MOVED_MODULES.get(module, module), name)


_PICKLE = types.SimpleNamespace(__name__="pickle", Unpickler=_Unpickler, load=pickle.load)


def load_state(path: Path) -> dict:
    """trainer_state.pt, from this version or one that named the driver's classes by older modules."""
    return torch.load(path, weights_only=False, pickle_module=_PICKLE)


CHECKPOINTS = "checkpoints"  # under logging.output_dir


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS / f"step-{step:06d}"


def rng_state() -> dict:
    return {"torch": torch.random.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.random.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


@contextlib.contextmanager
def written_whole(target: Path):
    """A staging directory beside `target` that every rank writes into, renamed over `target` once all have:
    a crash never leaves half of it. Every rank enters it (under torchrun the writes inside are collective)."""
    main = distributed.world().is_main
    staging = target.with_name(target.name + ".tmp")
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    distributed.barrier()  # the directory exists before any rank writes into it
    yield staging
    distributed.barrier()  # every rank's files are written before the directory is renamed
    if main:
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)


def save_checkpoint(output_dir: Path, step: int, policy, optimizer, scheduler, prompts, keep: int,
                    rollouts: dict | None = None) -> Path:
    """Under torchrun every rank calls it: the adapter is gathered and written by rank 0, the sharded
    optimizer state written by every rank (torch.distributed.checkpoint), the rest by rank 0."""
    world = distributed.world()
    target = checkpoint_dir(output_dir, step)
    with written_whole(target) as staging:
        policy.save_trained(staging / policy.trained_name)
        state = {"step": step, "scheduler": scheduler.state_dict(), "rng": rng_state()}
        if world.distributed:
            from driver.distributed.fsdp import save_optimizer

            save_optimizer(staging, policy.model, optimizer, with_weights=not policy.has_adapter)
        else:
            state["optimizer"] = optimizer.state_dict()
        if world.is_main:
            torch.save({**state, "data": prompts.state_dict(), "rollouts": rollouts}, staging / STATE_FILE)
        if policy.reference_moves:  # algo.sync_ref_model (full fine-tuning): no longer the base
            policy.save_reference(staging / REFERENCE_FILE)
    if world.is_main:
        for old in sorted(target.parent.glob("step-*[0-9]"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


BEST = "best"  # under logging.output_dir
BEST_FILE = "best.json"


class BestAdapter:
    """eval.save_best (TRL's load_best_model_at_end + metric_for_best_model): after each evaluation, the trained
    weights go to output_dir/best/ when its metric beats the best so far (a resumed run's too, read from
    best.json). Under torchrun every rank calls consider() (the save is collective) and rank 0 decides: only
    its file system is sure to hold best.json."""

    def __init__(self, output_dir: Path, key: str, greater_is_better: bool) -> None:
        """key: the metric's (eval.best_key(): eval/reward, eval_<set>/reward with eval.sets)."""
        self.directory, self.key, self.greater = output_dir / BEST, key, greater_is_better
        saved = self.directory / BEST_FILE
        self.best = json.loads(saved.read_text()) if saved.is_file() else None

    def consider(self, step: int, metrics: dict[str, float], policy) -> bool:
        """Save the policy's weights if `metrics` (an evaluation's, eval/...) beat the best; True if they did. An
        evaluation without the metric (no group could be scored) or with a NaN never does."""
        key = self.key
        value = metrics.get(key)
        world = distributed.world()
        improves = (value is not None and math.isfinite(value)
                    and (self.best is None or (value > self.best[key] if self.greater else value < self.best[key])))
        if not distributed.broadcast(improves if world.is_main else None):
            return False
        self.best = {"step": step, key: value}
        with written_whole(self.directory) as staging:
            policy.save_trained(staging)
            if world.is_main:
                (staging / BEST_FILE).write_text(json.dumps(self.best) + "\n")
        return True


NEWEST = ("latest", "auto")  # checkpoint.resume's names for output_dir's newest checkpoint


def find_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """checkpoint.resume's checkpoint: a path, or output_dir's newest (latest: one must be there; auto: None when
    none is, so the run starts, as axolotl's auto_resume_from_checkpoints: a command a requeued job reruns)."""
    if resume not in NEWEST:
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a checkpoint (no {STATE_FILE})")
        return path
    candidates = sorted((output_dir / CHECKPOINTS).glob("step-*[0-9]"))
    candidates = [c for c in candidates if (c / STATE_FILE).is_file()]  # a save cut short has none
    if not candidates and resume == "latest":
        raise FileNotFoundError(f"checkpoint.resume: latest requested but {output_dir / CHECKPOINTS} has none "
                                "(auto starts the run when there is none)")
    return candidates[-1] if candidates else None


def load_checkpoint(path: Path, policy, optimizer, scheduler, prompts) -> tuple[int, dict | None]:
    """Restore the adapter weights and all trainer state; returns the step the checkpoint ends and
    the rollout state (None in checkpoints written before it existed)."""
    if not (path / policy.trained_name).is_dir():
        other = "adapter" if policy.trained_name == "model" else "model"
        written = (f" but {'an adapter' if other == 'adapter' else 'a model'}/: it was written with model.adapter = "
                   f"{'lora' if other == 'adapter' else 'none'}" if (path / other).is_dir() else "")
        raise ValueError(f"{path} holds no {policy.trained_name}/{written}")
    policy.load_trained(path / policy.trained_name)
    state = load_state(path / STATE_FILE)
    if "optimizer" in state:
        saved = split_saved_group(state["optimizer"], optimizer, policy.trainable_parameters())
        if distributed.world().distributed:  # one process's state, whole: each rank keeps its shards
            from driver.distributed.fsdp import load_unsharded_optimizer

            load_unsharded_optimizer(policy.model, optimizer, saved, policy.trainable_parameters())
        else:
            optimizer.load_state_dict(saved)
    else:  # torchrun's sharded state: loads at any world size, one process included
        from driver.distributed.fsdp import load_optimizer

        # Full fine-tuning of 16-bit weights in one process (driver/update/master_weights.py): the fp32 shards are
        # its master weights, which stand in the model while they load.
        in_place_of_weights = getattr(optimizer, "in_place_of_weights", None)
        if in_place_of_weights is not None:
            with in_place_of_weights(policy.model) as inner:
                load_optimizer(path, policy.model, inner, with_weights=True)
        else:
            load_optimizer(path, policy.model, optimizer, with_weights=not policy.has_adapter)
    scheduler.load_state_dict(state["scheduler"])
    if policy.reference_moves and (path / REFERENCE_FILE).is_file():  # else the base: syncing starts from it
        policy.load_reference(path / REFERENCE_FILE)
    if prompts is not None:  # rank 0 only under torchrun
        prompts.load_state_dict(state["data"])
    set_rng_state(state["rng"])
    return int(state["step"]), state.get("rollouts")
