"""NF4 (QLoRA 4-bit NormalFloat) quantization, bitsandbytes-compatible.

>>> import torch, pykernels.nf4 as nf4
>>> w = nf4.quantize(torch.randn(256, 512), blocksize=64, double_quant=True)
>>> nf4.dequantize(w, torch.bfloat16).shape
torch.Size([256, 512])

dequantize is dispatched (pykernels/dispatch.py): ours, or the torch dequant of
pykernels.reference.nf4 (bitsandbytes' own pure-torch algorithm).
"""

from pykernels import dispatch
from pykernels.nf4_weight import NF4Weight
from pykernels.ops import nf4 as _ops
from pykernels.ops.nf4 import quantize


def _bucket(weight, dtype=None, *, out=None):
    layout = f"shape={tuple(weight.shape)} blocksize={weight.blocksize}{' double_quant' if weight.double_quant else ''}"
    return weight.packed.device, dtype or (out.dtype if out is not None else weight.dtype), layout


# The decision runs both sides into fresh outputs (into one shared out, each would be compared with itself).
dequantize = dispatch.dispatched("nf4", _ops.dequantize, _bucket, probe={"out": None})

__all__ = ["NF4Weight", "dequantize", "quantize"]
