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
from driver.engine.base import Completion, Generator, RolloutError, SyncError


def sync_method(config: Config, model_config) -> str:
    """'lora' (the engine loads each adapter version) or 'weights' (merged weights pushed in place).

    auto picks 'weights' for MoE models on CPU, where vLLM's LoRA path for expert layers does not
    run (it is Triton-only), and 'lora' everywhere else."""
    if config.model.adapter == "none":
        return "weights"  # full fine-tuning: no adapter to load
    if config.rollout.sync != "auto":
        return config.rollout.sync
    import torch

    from driver.policy.model import is_moe

    return "weights" if is_moe(model_config) and not torch.cuda.is_available() else "lora"


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
    method = sync_method(config, policy.causal_lm.config)
    if method == "weights" and config.rollout.backend == "server" and config.model.adapter == "none":
        from driver.engine.server import ServerGenerator

        # Reloads the whole weights from disk at every sync.
        return ServerGenerator(config, engine_model_dir(config, policy))
    if method == "weights":
        if config.rollout.backend != "colocate" or config.model.qlora:
            raise SyncError("rollout.sync = weights (used for MoE models on CPU) needs rollout.backend = colocate "
                            "and a dense base (model.qlora = false)")
        from driver.engine.colocate_weights import WeightSyncGenerator

        return WeightSyncGenerator(config, policy.model_dir, policy.model)
    if config.rollout.backend == "colocate":
        from driver.engine.colocate import ColocatedGenerator

        return ColocatedGenerator(config, engine_model_dir(config, policy))
    from driver.engine.server import ServerGenerator

    return ServerGenerator(config, engine_model_dir(config, policy))


__all__ = ["Completion", "Generator", "RolloutError", "SyncError", "make_generator"]
