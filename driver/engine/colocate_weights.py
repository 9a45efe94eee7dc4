"""Colocated vLLM without LoRA (rollout.weight_sync = merged): every sync merges the adapter into full
weights, computed from the trainer's untouched base, and loads them into the running engine in place
(driver/engine/weight_sync.py); under full fine-tuning it loads the trained weights themselves. No
LoRA at generation time; the only way vLLM on CPU serves LoRA on MoE experts (its LoRA path for
expert layers is Triton-only)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from driver.config import Config
from driver.engine.base import RolloutError
from driver.engine.colocate import ColocatedGenerator, engine_kwargs
from driver.engine.weight_sync import create_inprocess_engine, push_merged, shutdown_engine


class WeightSyncGenerator(ColocatedGenerator):
    serves_one_version = True  # in-place weights: a job of an older version cannot run after a push
    reads_saved_weights = False  # the weights go by reference: push_adapter writes no directory

    # Does not call super().__init__(): that builds a LoRA engine.
    def __init__(self, config: Config, model_dir: str, policy_model: nn.Module) -> None:
        self.config, self.adapter_version, self._lora, self.keep_versions = config, 0, None, 1
        self._policy_model = policy_model
        self.llm = create_inprocess_engine(**engine_kwargs(config, model_dir, lora=False))

    def sync(self, adapter_dir: Path | None, version: int) -> None:
        push_merged(self.llm, self._policy_model)
        self.adapter_version = version

    def _lora_of(self, version: int):
        # One set of weights at a time: the prefetcher pushes version v only after every job
        # sampled with an older one has finished (driver/rollouts/prefetch.py).
        if version != self.adapter_version:
            raise RolloutError(f"the engine serves weights of version {self.adapter_version}, not {version}")
        return None

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                shutdown_engine(llm)
            except Exception:  # already gone (e.g. after Ctrl-C)
                pass
