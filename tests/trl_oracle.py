"""TRL's own code as a test oracle (trl is in the test extra; the driver never imports it).

Importing trl sets VLLM_LOGGING_LEVEL=ERROR in os.environ when vLLM is installed (trl/_compat.py,
_patch_vllm_logging). In a test process that would reach every subprocess started after it (a pytest
worker collects every test module before the end-to-end tier's runs start, and their vLLM then logs
nothing below ERROR: the demo's run.log check failed so). trl is imported here with the environment
put back.
"""

import importlib
import os
from types import ModuleType


def import_trl(module: str) -> ModuleType:
    """trl's `module` (e.g. "trl.rewards"), imported without changing os.environ."""
    saved = dict(os.environ)
    try:
        return importlib.import_module(module)
    finally:
        if dict(os.environ) != saved:
            os.environ.clear()
            os.environ.update(saved)
