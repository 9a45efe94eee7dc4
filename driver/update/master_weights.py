"""fp32 master weights for 16-bit trainable weights (train.master_weights): full fine-tuning in bf16 / fp16.

An optimizer stepping a bf16 weight rounds the new value to bf16, so an update below half the weight's
rounding step (2^-9 to 2^-8 of its magnitude: 6e-5 for a weight of 0.02) is lost. Adam's updates are about the
learning rate, and TRL's default for GRPO is 1e-6: stepped in bf16, most of a model's weights would never
move (measured: 1.9% of them moved in 10 AdamW steps at 1e-6, against every one in fp32). TRL's single-GPU
full fine-tuning trains a bf16 model that way. Here the optimizer steps fp32 copies of those weights (its
moments fp32 with them) and writes each back rounded after every step: the mixed precision DeepSpeed and
FSDP give their users. Adapters need none: PEFT keeps LoRA weights in fp32 over a bf16 base.

The gradients are summed in fp32 too: each 16-bit gradient is added into its master's as soon as backward has
accumulated it (a post-accumulate-grad hook) and freed. Summed in bf16, every micro-batch's addition rounds the
running sum to 8 significant bits (measured on a bf16 linear layer: the step's gradient 0.3% off with 4
micro-batches, 0.6% with 32) and clipping would take a bf16 norm; FSDP's path (driver/distributed/fsdp.py)
reduces in fp32 the same way. The update's gradients are then the masters' (`gradient_holders`), which clipping
and zero-filling act on.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

SIXTEEN_BIT = (torch.bfloat16, torch.float16)

# A 16-bit weight's fp32 master, of the newest MasterWeightsOptimizer over it (weak: a dropped optimizer's masters go
# with it). Its hook is registered once, with the weight's first entry, and reads the master here.
_MASTERS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def needs_master_weights(parameters: list[torch.nn.Parameter]) -> bool:
    return any(parameter.dtype in SIXTEEN_BIT for parameter in parameters)


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """`build(tensors)`'s optimizer over fp32 copies of the 16-bit parameters (fp32 ones are stepped as they
    are). Its param_groups and state are the inner optimizer's, so the schedule, algo.use_adaptive_entropy's
    coefficient and checkpoints see one optimizer; its state_dict carries the fp32 weights, so a resume
    continues from them rather than from the rounded ones."""

    def __init__(self, parameters: list[torch.nn.Parameter],
                 build: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.model_parameters = list(parameters)
        self.masters = [torch.nn.Parameter(p.detach().float()) if p.dtype in SIXTEEN_BIT else p
                        for p in self.model_parameters]
        self.copied = [index for index, p in enumerate(self.model_parameters) if p.dtype in SIXTEEN_BIT]  # positions
        self.inner = build(self.masters)
        super().__init__(self.masters, self.inner.defaults)
        self._share_inner()
        for parameter, master in self._copies():
            if parameter not in _MASTERS:
                parameter.register_post_accumulate_grad_hook(_add_into_master)
            _MASTERS[parameter] = weakref.ref(master)

    def _share_inner(self) -> None:
        # The inner optimizer's load_state_dict replaces its lists: shared again after every load.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def _copies(self):
        return ((self.model_parameters[index], self.masters[index]) for index in self.copied)

    @contextlib.contextmanager
    def in_place_of_weights(self, model: torch.nn.Module):
        """Yields the inner optimizer while the masters stand in the model for the weights they copy (same modules,
        same names): torch's state-dict helpers then see the fp32 masters, and the inner optimizer's state under
        the model's parameter names (how a torchrun checkpoint's sharded state loads in one process,
        driver/checkpoint.py). After it the weights take the masters, rounded."""
        stand_ins = {id(parameter): master for parameter, master in self._copies()}
        swapped = []
        for module in model.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None and id(parameter) in stand_ins:
                    module._parameters[name] = stand_ins[id(parameter)]
                    swapped.append((module, name, parameter))
        try:
            yield self.inner
        finally:
            for module, name, parameter in swapped:
                module._parameters[name] = parameter
            self._share_inner()
            with torch.no_grad():
                for parameter, master in self._copies():
                    parameter.copy_(master)

    def gradient_holders(self) -> list[torch.nn.Parameter]:
        """The tensors whose .grad is the update's gradient (the masters), with any gradient still on a 16-bit
        weight (one assigned rather than accumulated by backward) added into its master first."""
        for parameter, master in self._copies():
            _add_into(parameter, master)
        return self.masters

    @torch.no_grad()
    def step(self, closure=None):
        self.gradient_holders()
        loss = self.inner.step(closure)
        for parameter, master in self._copies():
            parameter.copy_(master)  # rounded to nearest
            master.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.model_parameters:
            if set_to_none:
                parameter.grad = None
            elif parameter.grad is not None:
                parameter.grad.zero_()
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """The inner optimizer's state and the masters, keyed by their weight's position in `parameters` (a sharded
        resume, whose weights are all fp32, could not tell from a list which weights they copy:
        driver/distributed/fsdp.py load_unsharded_optimizer)."""
        return {"inner": self.inner.state_dict(),
                "masters": {index: self.masters[index].detach() for index in self.copied}}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """A state without master weights (a checkpoint of a run without them) takes the model's weights."""
        masters = state_dict.get("masters")
        if isinstance(masters, list):  # written before they were keyed: one for each 16-bit weight, in order
            masters = dict(zip(self.copied, masters, strict=True))
        self.inner.load_state_dict(state_dict["inner"] if "inner" in state_dict else state_dict)
        self._share_inner()
        for index in self.copied:
            self.masters[index].copy_(masters[index] if masters is not None else self.model_parameters[index].float())


def _add_into_master(parameter: torch.Tensor) -> None:
    """The hook: into the master of the newest optimizer over the weight, if it is still there."""
    reference = _MASTERS.get(parameter)
    master = reference() if reference is not None else None
    if master is not None:
        _add_into(parameter, master)


@torch.no_grad()
def _add_into(parameter: torch.Tensor, master: torch.Tensor) -> None:
    """The weight's gradient added into the fp32 master's (or made it), the 16-bit one freed."""
    if parameter.grad is None:
        return
    if master.grad is None:
        master.grad = parameter.grad.float()
    else:
        master.grad.add_(parameter.grad)
    parameter.grad = None


def gradient_holders(optimizer: torch.optim.Optimizer | None,
                     parameters: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The tensors whose .grad is an update's gradient: a MasterWeightsOptimizer's masters, else the parameters."""
    if isinstance(optimizer, MasterWeightsOptimizer):
        return optimizer.gradient_holders()
    return parameters
