"""Colocated vLLM without LoRA (rollout.weight_sync = merged): every sync merges the adapter into full
weights, computed from the trainer's untouched base, and loads them into the running engine in place
(driver/engine/weight_sync.py); under full fine-tuning it loads the trained weights themselves. No
LoRA at generation time; the only way vLLM on CPU serves LoRA on MoE experts (its LoRA path for
expert layers is Triton-only).

Full fine-tuning under torchrun (ReloadingGenerator): the weights are FSDP shards, and an engine in rank 0's
own process would start vLLM's process group inside torchrun's, waiting for ranks that never join it; the
engine runs in a process of its own instead and every sync reloads the whole weights rank 0 wrote from the
gathered shards, as a server does (driver/engine/server_worker.py's reload)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from driver.config import Config
from driver.engine.base import RolloutError
from driver.engine.colocate import ColocatedGenerator, engine_kwargs, set_cpu_defaults
from driver.engine.server_worker import EXTENSION, RELOAD_METHOD
from driver.engine.weight_sync import create_inprocess_engine, push_merged, shutdown_engine


class InPlaceWeightsGenerator(ColocatedGenerator):
    """A colocated engine without LoRA whose weights each sync replaces (subclasses build the engine and sync)."""

    serves_one_version = True  # in-place weights: a job of an older version cannot run after a push

    def _lora_of(self, version: int):
        # One set of weights at a time: the prefetcher pushes version v only after every job
        # sampled with an older one has finished (driver/rollouts/prefetch.py).
        if version != self.adapter_version:
            raise RolloutError(f"the engine serves weights of version {self.adapter_version}, not {version}")
        return None


class WeightSyncGenerator(InPlaceWeightsGenerator):
    reads_saved_weights = False  # the weights go by reference: push_adapter writes no directory

    # Does not call super().__init__(): that builds a LoRA engine.
    def __init__(self, config: Config, model_dir: str, policy_model: nn.Module) -> None:
        self.config, self.adapter_version, self._lora, self.keep_versions = config, 0, None, 1
        self._policy_model = policy_model
        self.llm = create_inprocess_engine(**engine_kwargs(config, model_dir, lora=False))

    def sync(self, adapter_dir: Path | None, version: int) -> None:
        push_merged(self.llm, self._policy_model)
        self.adapter_version = version

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                shutdown_engine(llm)
            except Exception:  # already gone (e.g. after Ctrl-C)
                pass


class ReloadingGenerator(InPlaceWeightsGenerator):
    """Full fine-tuning under torchrun, colocated on rank 0: the engine core in a process of its own (vLLM's
    default), each sync a reload of every weight from the directory push_adapter wrote."""

    # Does not call super().__init__(): that builds a LoRA engine.
    def __init__(self, config: Config, model_dir: str) -> None:
        set_cpu_defaults()  # before vllm is imported: it reads these at import
        from vllm import LLM

        self.config, self.adapter_version, self._lora, self.keep_versions = config, 0, None, 1
        self.llm = LLM(**engine_kwargs(config, model_dir, lora=False), worker_extension_cls=EXTENSION)

    def sync(self, adapter_dir: Path, version: int) -> None:
        self.llm.collective_rpc(RELOAD_METHOD, kwargs={"weights_path": str(adapter_dir)})
        self.llm.reset_prefix_cache()  # its KV was computed with the old weights
        self.adapter_version = version
