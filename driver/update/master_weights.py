"""fp32 master weights for 16-bit trainable weights (train.master_weights): full fine-tuning in bf16 / fp16.

An optimizer stepping a bf16 weight rounds the new value to bf16, so an update below half the weight's
rounding step (2^-9 to 2^-8 of its magnitude: 6e-5 for a weight of 0.02) is lost. Adam's updates are about the
learning rate, and TRL's default for GRPO is 1e-6: stepped in bf16, most of a model's weights would never
move (measured: 1.9% of them moved in 10 AdamW steps at 1e-6, against every one in fp32). TRL's single-GPU
full fine-tuning trains a bf16 model that way. Here the optimizer steps fp32 copies of those weights (its
moments fp32 with them) and writes each back rounded after every step: the mixed precision DeepSpeed and
FSDP give their users. Adapters need none: PEFT keeps LoRA weights in fp32 over a bf16 base.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


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
        self.inner = build(self.masters)
        super().__init__(self.masters, self.inner.defaults)
        self._share_inner()

    def _share_inner(self) -> None:
        # The inner optimizer's load_state_dict replaces its lists: shared again after every load.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def _copies(self):
        return ((p, master) for p, master in zip(self.model_parameters, self.masters, strict=True) if master is not p)

    @torch.no_grad()
    def step(self, closure=None):
        for parameter, master in self._copies():
            master.grad = None if parameter.grad is None else parameter.grad.float()
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
        return {"inner": self.inner.state_dict(), "masters": [master.detach() for _, master in self._copies()]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """A state without master weights (a checkpoint of a run without them) takes the model's weights."""
        masters = state_dict.get("masters")
        self.inner.load_state_dict(state_dict["inner"] if "inner" in state_dict else state_dict)
        self._share_inner()
        for index, (parameter, master) in enumerate(self._copies()):
            master.copy_(masters[index] if masters is not None else parameter.float())
