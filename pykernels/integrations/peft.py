"""Route PEFT LoRA layers through pykernels' fused LoRA linear.

    n = pykernels.integrations.peft.apply_fused_lora(peft_model)   # layers now fused
    pykernels.integrations.peft.unpatch(peft_model)                # PEFT's own forward again

Only the forward method of each layer instance is swapped: parameters, adapter names, saving
(`save_pretrained` writes the unchanged PEFT format), merging and `disable_adapter()` are PEFT's.
Supported bases: nn.Linear, pykernels NF4Linear, and bitsandbytes Linear4bit (NF4), whose packed
weight is used as is (no re-quantization). A layer falls back to PEFT's forward for anything the
kernel does not cover: several active adapters, merged or disabled adapters, mixed-adapter batches,
or an input dtype that differs from a dense base weight's (autocast).
"""

from __future__ import annotations

import types
import warnings

import torch
from torch import nn

from pykernels.nf4_weight import NF4Weight
from pykernels.lora import lora_linear  # dispatched: ours or torch per bucket (pykernels/dispatch.py)

_ORIGINAL = "_pykernels_original_forward"


def _lora_layer_classes() -> tuple[type, ...]:
    from peft.tuners.lora.layer import Linear

    classes: list[type] = [Linear]
    try:
        from peft.tuners.lora.bnb import Linear4bit

        classes.append(Linear4bit)
    except (ImportError, AttributeError):  # bitsandbytes not installed
        pass
    return tuple(classes)


def _unsupported(layer: nn.Module) -> str | None:
    """Why a LoRA layer cannot be fused, or None."""
    from pykernels.nn import NF4Linear

    if any(getattr(layer, "use_dora", {}).values()):
        return "DoRA (use_dora=True) is not fused"
    if any(getattr(layer, "lora_bias", {}).values()):
        return "LoRA bias (lora_bias=True) is not fused"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out (Conv1D) weights are not fused"
    base = layer.get_base_layer()
    if isinstance(base, NF4Linear) or type(base) is nn.Linear:
        return None
    if type(base).__name__ == "Linear4bit" and getattr(base.weight, "quant_type", "nf4") == "nf4":
        return None
    return f"base layer {type(base).__name__} is not supported (nn.Linear, NF4Linear, bitsandbytes NF4 Linear4bit)"


def apply_fused_lora(model: nn.Module) -> int:
    """Patch every PEFT LoRA Linear layer of `model` that the fused kernel supports; returns how many."""
    patched = 0
    for name, module in model.named_modules():
        if not isinstance(module, _lora_layer_classes()) or _ORIGINAL in module.__dict__:
            continue
        reason = _unsupported(module)
        if reason is not None:
            warnings.warn(f"pykernels: {name} left on PEFT's forward: {reason}", stacklevel=2)
            continue
        setattr(module, _ORIGINAL, module.forward)
        module.forward = types.MethodType(_fused_forward, module)
        patched += 1
    return patched


def unpatch(model: nn.Module) -> int:
    """Undo apply_fused_lora; returns how many layers were restored."""
    restored = 0
    for module in model.modules():
        if _ORIGINAL in module.__dict__:
            del module.__dict__["forward"]
            delattr(module, _ORIGINAL)
            module.__dict__.pop("_pykernels_nf4_cache", None)
            restored += 1
    return restored


def _base_weight(layer: nn.Module):
    """The frozen weight for the kernel: a Tensor, or an NF4Weight (bitsandbytes' converted once)."""
    base = layer.get_base_layer()
    weight = base.weight
    if isinstance(weight, NF4Weight) or type(base) is nn.Linear:
        return weight.detach() if isinstance(weight, torch.Tensor) else weight
    cache = layer.__dict__.get("_pykernels_nf4_cache")
    if cache is None or cache[0] is not weight.data:
        cache = (weight.data, NF4Weight.from_bnb_params(weight))
        layer.__dict__["_pykernels_nf4_cache"] = cache
    return cache[1]


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    original = self.__dict__[_ORIGINAL]
    active = [name for name in self.active_adapters if name in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or len(active) != 1:
        return original(x, *args, **kwargs)
    adapter = active[0]
    weight, bias = _base_weight(self), self.get_base_layer().bias
    lora_dtype = self.lora_A[adapter].weight.dtype
    if ((isinstance(weight, torch.Tensor) and weight.dtype != x.dtype) or (bias is not None and bias.dtype != x.dtype)
            or lora_dtype not in (x.dtype, torch.float32)):
        return original(x, *args, **kwargs)  # autocast / mixed dtypes: PEFT's casting rules apply
    dropout = self.lora_dropout[adapter]
    probability = dropout.p if isinstance(dropout, nn.Dropout) and self.training else 0.0
    return lora_linear(x, weight, self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.scaling[adapter],
                       bias=bias, dropout=probability)
