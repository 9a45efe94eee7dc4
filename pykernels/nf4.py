"""NF4 (QLoRA 4-bit NormalFloat) quantization, bitsandbytes-compatible.

>>> import torch, pykernels.nf4 as nf4
>>> w = nf4.quantize(torch.randn(256, 512), blocksize=64, double_quant=True)
>>> nf4.dequantize(w, torch.bfloat16).shape
torch.Size([256, 512])
"""

from pykernels.nf4_weight import NF4Weight
from pykernels.ops.nf4 import dequantize, quantize

__all__ = ["NF4Weight", "dequantize", "quantize"]
