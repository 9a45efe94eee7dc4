"""Loads the compiled extension (which registers torch.ops.pykernels) and checks devices."""

from __future__ import annotations

import torch

try:
    from pykernels import _C
except ImportError as error:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "pykernels._C is missing or was built against another torch "
        f"(torch here is {torch.__version__}). Build it with `make build` or "
        "`pip install --no-build-isolation -e .` in this environment (a `pip install .` "
        "from another directory is not used by this source tree)."
    ) from error

ops = torch.ops.pykernels

# Read once: a plain bool that torch.compile treats as a constant (dynamo cannot trace a pybind call,
# so calling _C.has_cuda() inside a compiled region breaks the graph with an error).
HAS_CUDA: bool = _C.has_cuda()


def build_info() -> dict:
    """What this build contains: kernel families, CUDA on/off and archs, CUTLASS/torch versions."""
    return _C.build_info()


def check_device(tensor: torch.Tensor, name: str) -> None:
    """Raise a clear error when ``tensor`` lives where this build has no kernels."""
    if tensor.device.type == "cpu":
        return
    if tensor.device.type == "cuda":
        if not HAS_CUDA:
            raise RuntimeError(
                f"{name} is on {tensor.device}, but this pykernels build has no CUDA kernels "
                "(torch had no CUDA or nvcc was not found when it was built); rebuild on the GPU "
                "machine with `pip install --no-build-isolation --no-deps -e .`"
            )
        return
    raise RuntimeError(f"{name} is on {tensor.device}; pykernels has kernels for cpu and cuda only")
