"""FSDP2 for the policy under torchrun: shard it, gather its adapter, checkpoint its optimizer.

Sharding (torch.distributed.fsdp.fully_shard): every decoder layer is a unit, then the decoder (the
embeddings and final norm) as the root unit; the lm_head stays out of FSDP, a plain frozen tensor on
every rank, because the driver reads its weight outside any module forward (pykernels'
token_logprobs fuses it), and a sharded weight read there is a DTensor the op cannot take. FSDP
all-gathers a unit's parameters in its forward pre-hook and swaps plain tensors in for the forward,
so pykernels' fused LoRA and grouped MoE kernels see ordinary tensors (measured: no DTensor reaches
them). The LoRA parameters, their gradients and AdamW's state are DTensors sharded on dim 0; build the
optimizer after shard_policy (fully_shard replaces the Parameter objects).

FSDP averages gradients over ranks while the driver's loss is already normalized by the counts of the
whole step (driver/rollouts/shard_batch.py), so the update multiplies each rank's loss by the world size.
"""

from __future__ import annotations

from pathlib import Path

import torch

OPTIMIZER_DIR = "optimizer"  # the DCP checkpoint of the sharded optimizer state, one file per rank


def shard_policy(policy) -> None:
    from torch.distributed.fsdp import fully_shard

    decoder = policy.causal_lm.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(decoder)
    keep_output_capturing(decoder)


def keep_output_capturing(module) -> None:
    """fully_shard swaps the module's class for a subclass (FSDPQwen2Model); transformers looks up which
    outputs a model can record (`output_hidden_states`, which EBFT's features read) by the class's name
    (output_capturing._CAN_RECORD_REGISTRY, filled in PreTrainedModel.__init__), so the sharded decoder
    would silently return hidden_states=None. Register the new class with the model's own entry."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # a transformers without the registry looks the outputs up some other way
        return
    recordable = getattr(module, "_can_record_outputs", None)
    if recordable is not None:
        _CAN_RECORD_REGISTRY.setdefault(str(module.__class__), recordable)


def full_adapter_state(model) -> dict[str, torch.Tensor]:
    """Every rank calls it (a collective); rank 0 gets the full trainable (LoRA) tensors on the CPU,
    the others {}. Keys are the model's (PEFT's `save_pretrained(state_dict=...)` takes them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                  ignore_frozen_params=True))


def save_optimizer(directory: Path, model, optimizer) -> None:
    """Every rank writes its shard of the AdamW state (keyed by parameter name, not id) with
    torch.distributed.checkpoint; the checkpoint loads at any world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=str(directory / OPTIMIZER_DIR))


def load_optimizer(directory: Path, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(ignore_frozen_params=True, strict=False)  # strict: every frozen weight "missing"
    _, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / OPTIMIZER_DIR))
    set_state_dict(model, optimizer, model_state_dict={}, optim_state_dict=state["optimizer"], options=options)
