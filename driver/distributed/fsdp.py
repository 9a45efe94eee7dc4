"""FSDP2 for the policy under torchrun: shard it, gather its adapter (or its weights), checkpoint its
optimizer.

Sharding (torch.distributed.fsdp.fully_shard), with an adapter: every decoder layer is a unit, then the
decoder (the embeddings and final norm) as the root unit; the frozen lm_head stays out of FSDP, a plain
tensor on every rank, because the driver reads its weight outside any module forward (pykernels'
token_logprobs fuses it), and a sharded weight read there is a DTensor the op cannot take.

Under full fine-tuning the lm_head trains (and may be the embeddings' own weight, tied), so it is
sharded with them: the layers are units and the causal LM is the root unit (embeddings, final norm,
lm_head). The driver never calls the causal LM's forward, only its decoder's, so the decoder's forward
runs the root's FSDP hooks (count_decoder_forward_as_root): the root's weights are all-gathered when the
decoder starts and, the root not resharding after forward, the lm_head weight the driver reads after the
decoder is the gathered plain tensor, whose gradient FSDP reduce-scatters at the end of backward
(measured: the gradients of every weight equal one process's on the same batch). fp32 master weights
(train.master_weights) are FSDP's mixed precision: the shards are fp32, the gathered weights the model's
16-bit dtype, gradients reduced in fp32. FSDP
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

from driver.distributed.no_decay_group import merged_groups, predates_no_decay_group, split_loaded_group

OPTIMIZER_DIR = "optimizer"  # the DCP checkpoint of the sharded optimizer state, one file per rank


def shard_policy(policy, master_weights: bool = True) -> None:
    """Shard the policy (and under full fine-tuning its frozen reference, when a KL term keeps one) over the
    ranks. master_weights: full fine-tuning of a 16-bit model keeps fp32 shards (train.master_weights)."""
    from torch.distributed.fsdp import fully_shard

    if not policy.has_adapter:
        shard_full_model(policy.model, master_weights)
        if policy.frozen_reference is not None:
            shard_full_model(policy.frozen_reference, master_weights=False)
        return
    decoder = policy.causal_lm.get_decoder()
    for layer in decoder.layers:
        fully_shard(layer)
    fully_shard(decoder)
    keep_output_capturing(decoder)


def shard_full_model(causal_lm, master_weights: bool) -> None:
    """Every weight sharded: the decoder layers as units, the causal LM (embeddings, final norm, lm_head) as
    the root. A 16-bit model with master weights is upcast one unit at a time before it is sharded (never the
    whole model in fp32 at once) and computes in its own dtype (FSDP's MixedPrecisionPolicy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = causal_lm.get_output_embeddings().weight.dtype
    mixed = master_weights and is_sixteen_bit(dtype)
    precision = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if mixed
                 else MixedPrecisionPolicy())
    decoder = causal_lm.get_decoder()
    upcast: dict[int, torch.nn.Parameter] = {}  # tied weights stay one parameter
    for layer in decoder.layers:
        if mixed:
            upcast_parameters(layer, upcast)
        fully_shard(layer, mp_policy=precision)
    if mixed:
        upcast_parameters(causal_lm, upcast)
    fully_shard(causal_lm, mp_policy=precision)
    count_decoder_forward_as_root(causal_lm)
    keep_output_capturing(causal_lm)  # the one class swapped above the layers (the decoder is no unit here)


def upcast_parameters(module, done: dict[int, torch.nn.Parameter]) -> None:
    """module's 16-bit parameters (not those already sharded) replaced by fp32 ones; a parameter two modules
    share (a tied lm_head) gets one fp32 replacement."""
    from torch.distributed.tensor import DTensor

    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is None or isinstance(param, DTensor) or not is_sixteen_bit(param.dtype):
                continue
            if id(param) not in done:
                done[id(param)] = torch.nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
            owner._parameters[name] = done[id(param)]


def is_sixteen_bit(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 2  # bfloat16, float16


def count_decoder_forward_as_root(causal_lm) -> None:
    """Run the root's FSDP pre- and post-forward hooks around the decoder's forward, as
    register_fsdp_forward_method does for a method of the root itself: the driver computes hidden states
    with the decoder and the logprobs with the lm_head's weight (pykernels' fused op), never calling the
    causal LM's forward."""
    import types

    decoder = causal_lm.get_decoder()
    forward = decoder.forward

    def forward_as_root(self, *args, **kwargs):  # the calls register_fsdp_forward_method's wrapper makes
        state = causal_lm._get_fsdp_state()
        args, kwargs = state._pre_forward(causal_lm, args, kwargs)
        return state._post_forward(causal_lm, args, forward(*args, **kwargs))

    decoder.forward = types.MethodType(forward_as_root, decoder)


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

    reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                  ignore_frozen_params=True))


def reshard(model) -> None:
    """Every FSDP unit of the model back to its shards. The root does not reshard after its forward (its
    gathered weights wait for backward); after a forward without backward they would stay gathered, and an
    optimizer step in between would update the shards while the next forward, finding the weights gathered,
    computed with the old ones. Called before every optimizer step and before the shards are read."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def reshard_before_steps(optimizer, model) -> None:
    optimizer.register_step_pre_hook(lambda *_: reshard(model))


def full_model_state(model) -> dict[str, torch.Tensor]:
    """Every rank calls it (a collective); rank 0 gets every weight of the sharded model whole, on the CPU (in the
    shards' dtype: fp32 under master weights), the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    reshard(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state(model, state: dict[str, torch.Tensor]) -> None:
    """Every rank calls it with the whole weights (each read them from disk): each keeps its shards. A weight
    save_pretrained leaves out (tied to another) is the caller's to check."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reshard(model)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def save_optimizer(directory: Path, model, optimizer, with_weights: bool = False) -> None:
    """Every rank writes its shard of the AdamW state (keyed by parameter name, not id) with
    torch.distributed.checkpoint; the checkpoint loads at any world size. with_weights (full fine-tuning): the
    weights' shards too, in their own dtype, so a resume continues from the fp32 master weights rather than
    from the 16-bit model/ written beside them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    reshard(model)
    weights, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    state = {"optimizer": optimizer_state, **({"model": weights} if with_weights else {})}
    dcp.save(state, checkpoint_id=str(directory / OPTIMIZER_DIR))


def load_optimizer(directory: Path, model, optimizer, with_weights: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(ignore_frozen_params=True, strict=False)  # strict: every frozen weight "missing"
    reshard(model)
    weights, optimizer_state = get_state_dict(model, optimizer, options=options)
    groups = optimizer_state["param_groups"]
    saved_keys = dcp.FileSystemReader(str(directory / OPTIMIZER_DIR)).read_metadata().state_dict_metadata
    saved_groups = {key.split(".")[2] for key in saved_keys if key.startswith("optimizer.param_groups.")}
    split = predates_no_decay_group(len(saved_groups), groups)
    if split:  # loaded as the one group it was saved as
        optimizer_state["param_groups"] = merged_groups(groups)
    state = {"optimizer": optimizer_state, **({"model": weights} if with_weights else {})}
    dcp.load(state, checkpoint_id=str(directory / OPTIMIZER_DIR))
    if split:
        optimizer_state["param_groups"] = split_loaded_group(optimizer_state["param_groups"], groups)
    set_state_dict(model, optimizer, model_state_dict=state.get("model", {}), optim_state_dict=state["optimizer"],
                   options=options)


def load_unsharded_optimizer(model, optimizer, saved: dict, parameters: list) -> None:
    """A one-process checkpoint's optimizer state into the sharded optimizer (every rank calls it; each read the state
    whole and keeps its shards: torch's full-state-dict load). `saved` is torch's state_dict, keyed by position in
    the optimizer's parameter groups, which the sharded optimizer, built by the same code over the same weights,
    holds in the same order: the positions become the weights' names. Full fine-tuning's fp32 master weights
    (driver/update/master_weights.py: "inner" and "masters", keyed by position in `parameters`, the order the
    optimizer was built from) become the fp32 shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    name_of = {id(parameter): name for name, parameter in model.named_parameters()}
    inner = saved.get("inner", saved)
    saved_sizes, sizes = ([len(group["params"]) for group in groups]
                          for groups in (inner["param_groups"], optimizer.param_groups))
    if saved_sizes != sizes:
        raise ValueError(f"the one-process checkpoint's optimizer state has parameter groups of {saved_sizes} weights "
                         f"where this run's has {sizes}: it was written with other trainable weights (model.adapter, "
                         "lora.*) or another train.weight_decay")
    names = [name_of[id(parameter)] for group in optimizer.param_groups for parameter in group["params"]]
    state = {"state": {names[index]: value for index, value in inner["state"].items()},
             "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                              for group in inner["param_groups"]]}
    for group, saved_group in zip(optimizer.param_groups, inner["param_groups"], strict=True):
        for key, value in saved_group.items():  # torch's load maps only keys the groups have (initial_lr: a schedule's)
            if key != "params":
                group.setdefault(key, value)
    options = StateDictOptions(full_state_dict=True, strict=False)
    reshard(model)
    masters = saved.get("masters") if "inner" in saved else None
    if masters is not None:
        if isinstance(masters, list):  # written before they were keyed: one for each 16-bit weight, in order
            if len(masters) != len(parameters):  # then it cannot tell which they copy
                raise ValueError(f"the one-process checkpoint lists {len(masters)} master weights for "
                                 f"{len(parameters)} weights without saying which (an older version wrote it): "
                                 "resume it in one process")
            masters = dict(enumerate(masters))
        set_model_state_dict(model, {name_of[id(parameters[index])]: master for index, master in masters.items()},
                             options=options)
    set_optimizer_state_dict(model, optimizer, state, options=options)
