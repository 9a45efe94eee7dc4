"""The inference engine: vLLM in the training process (`colocate`, or `colocate_weights` for merged
full-weight sync) or as an OpenAI-compatible server (`server`: launched by `launch`, reached through
`server_client`, with timeouts, retries and several data-parallel servers), behind one interface; the
engine options checked against this machine (`options`); and the adapter sync that makes it serve the
trainer's current adapter (`adapter_sync`, verified by a probe in `sync_check`).

Interface: `base.Generator` (generate / stream / sync / prompt_logprobs / close) with `Completion`
and `Request`; `make_generator(config, policy)` picks the backend; `served_base_dir(config, model_dir)`
is what a launched engine loads (also `python -m driver.vllm_serve`'s). Depends on config and policy.
"""

from __future__ import annotations

from driver.config import Config
from driver.distributed.world import world
from driver.engine.base import Completion, Generator, RolloutError, SyncError


def weight_sync_mode(config: Config, model_config) -> str:
    """'adapter' (the engine loads each adapter version as a LoRA adapter) or 'merged' (base + adapter
    merged, written into the engine's weights in place; under full fine-tuning: the whole weights).

    auto picks merged where it is both faster and exact: a colocated float32 engine that takes the weights
    in place (one in-process worker, awake between generations) with a dense trained base; measured on 2
    CPU cores, its step is 1.4-2x shorter (generation in this process on every core, without vLLM's LoRA
    path: benchmarks/results/cpu.md). Also MoE on CPU, whatever the dtype: there vLLM's LoRA path for expert
    layers does not run (it is Triton-only). adapter everywhere else: in bf16/fp16 a merged weight is
    rounded to the dtype, so adapter deltas below half a unit in the last place of the base weight are
    lost (TRL's merged sync has the same loss; an adapter keeps them), and a server would reload its
    weights from a file at every sync; QLoRA, torchrun, sleep mode and tensor parallelism cannot take it."""
    if config.model.adapter == "none":
        return "merged"  # full fine-tuning: no adapter to load
    mode = config.rollout.weight_sync if config.rollout.weight_sync != "auto" else _auto(config, model_config)
    if mode == "merged":
        _check_merged(config)
    return mode


def _auto(config: Config, model_config) -> str:
    import torch

    from driver.policy.model import is_moe

    rollout = config.rollout
    if is_moe(model_config) and not torch.cuda.is_available():
        return "merged"  # the only way vLLM on CPU serves LoRA on experts (colocated: _check_merged)
    exact = (rollout.dtype or config.model.dtype) == "float32" and not config.model.qlora
    in_place = (rollout.backend == "colocate" and rollout.tensor_parallel_size == 1 and not rollout.enable_sleep_mode
                and not world().distributed)
    return "merged" if exact and in_place and not is_moe(model_config) else "adapter"


def _check_merged(config: Config) -> None:
    """What merged serving cannot do that the config alone does not show (driver/config.py checks the rest):
    a ConfigError naming the keys, before the engine starts."""
    from driver.cli import ConfigError

    key = f"rollout.{config.rollout.weight_sync_key()}"
    if world().distributed:
        raise ConfigError(f"{key} under torchrun: the adapter and the base are sharded over the ranks (FSDP) and "
                          "the merge would need every rank's shards; use rollout.weight_sync = adapter")


def serves_trained_base(config: Config) -> bool:
    """The engine's base is the trainer's, value for value: not under QLoRA on a server the driver does
    not launch (it serves whatever base it was started with), nor when the engine serves another dtype
    (rollout.dtype) or quantizes the base (rollout.quantization)."""
    rollout = config.rollout
    return not ((config.model.qlora and rollout.backend == "server" and rollout.server_url)
                or rollout.dtype not in (None, config.model.dtype) or rollout.quantization is not None)


def engine_model_dir(config: Config, policy) -> str:
    """What this run's engine loads (served_base_dir of the policy's base)."""
    return served_base_dir(config, policy.model_dir)


def served_base_dir(config: Config, model_dir: str, launched: bool | None = None) -> str:
    """What the engine loads: the base, or under QLoRA the base round-tripped through NF4 as the trainer
    quantizes it (driver/policy/nf4_base.py: built once, cached), so that both compute with one base.
    launched: the driver starts this engine (default: unless the run connects to rollout.server_url;
    `python -m driver.vllm_serve` starts the server such a run connects to)."""
    launched = not (config.rollout.backend == "server" and config.rollout.server_url) if launched is None else launched
    if not config.model.qlora or not launched:
        return model_dir
    import torch

    from driver.policy.nf4_base import nf4_base

    return str(nf4_base(model_dir, getattr(torch, config.model.dtype), config.model.qlora_blocksize))


def make_generator(config: Config, policy) -> Generator:
    if config.rollout.backend == "transformers":
        from driver.engine.transformers_backend import TransformersGenerator

        return TransformersGenerator(config, policy)
    method = weight_sync_mode(config, policy.causal_lm.config)
    if config.rollout.backend == "server":
        from driver.engine.server import ServerGenerator

        # merged: every sync writes the merged weights into a file the server reloads in place.
        merges = method == "merged" and config.model.adapter != "none"  # full fine-tuning saves whole weights
        return ServerGenerator(config, engine_model_dir(config, policy), merge_from=policy.model if merges else None)
    if method == "merged":
        if config.model.qlora:  # auto's merged for MoE on CPU (explicit merged + QLoRA is a config error)
            raise SyncError("QLoRA on a mixture-of-experts model cannot run with vLLM on CPU: vLLM's LoRA path for "
                            "experts is Triton-only, and merged weights need a dense base (model.qlora = false)")
        from driver.engine.colocate_weights import ReloadingGenerator, WeightSyncGenerator

        if world().distributed:  # full fine-tuning's shards (merged LoRA is refused under torchrun)
            return ReloadingGenerator(config, policy.model_dir)
        return WeightSyncGenerator(config, policy.model_dir, policy.model)
    from driver.engine.colocate import ColocatedGenerator

    return ColocatedGenerator(config, engine_model_dir(config, policy))


__all__ = ["Completion", "Generator", "RolloutError", "SyncError", "make_generator"]
