"""The on-disk memory of pykernels.dispatch: which side won, per device and shape bucket.

One JSON file, $PYKERNELS_CACHE/dispatch.json (default ~/.cache/pykernels/dispatch.json), holding
one entry per *identity*: device name, GPU driver version, torch version, pykernels version, the
compiled extension's size and mtime, whether the Hopper GEMMs are on (PYKERNELS_SM90) and every
knob that picks other kernels or other sizes of them (KERNEL_KNOBS). A decision is only
valid for the identity that made it: a new driver, torch or kernel build can change who is faster
or whether ours is right, so any change means a fresh entry (re-decided on first use) and the
stale entries of that device are dropped.
Writes are atomic (temporary file + os.replace), so a crash or a second process never leaves a
half-written file; a file that does not parse is ignored with one warning and rewritten.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import platform
import tempfile
import warnings
from pathlib import Path

import torch

import pykernels

logger = logging.getLogger("pykernels")
FORMAT = 1

_identities: dict[str, dict] = {}  # str(device) -> identity, computed once per process
_identity_keys: dict[str, str] = {}  # str(device) -> _key(identity): every dispatched call looks it up
_entries: dict[str, dict] | None = None  # identity key -> {"decisions": {...}, "disabled": {...}}
_warned_corrupt: set[str] = set()


def cache_path() -> Path:
    return Path(os.environ.get("PYKERNELS_CACHE") or Path.home() / ".cache" / "pykernels") / "dispatch.json"


def _driver_version() -> str:
    """The CUDA driver's version (cuDriverGetVersion), "none" without one."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return str(version.value)
    except OSError:
        pass
    return "none"


def _extension_stamp() -> str:
    spec = importlib.util.find_spec("pykernels._C")
    if spec is None or not spec.origin:
        return "none"
    stat = os.stat(spec.origin)
    return f"{stat.st_size}-{int(stat.st_mtime)}"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} {platform.processor() or platform.machine()}"


# The knobs read on every call that pick other kernels, or other sizes of them (identity key ->
# environment variable; csrc/ names each one's choices): decisions made under one setting must not be
# reused for another.
KERNEL_KNOBS = {
    "sm90_tile": "PYKERNELS_SM90_TILE",  # the Hopper GEMM core's tile (common/sm90_tiles.h)
    "sm90_logprobs_tile": "PYKERNELS_SM90_LOGPROBS_TILE",  # the lm_head GEMMs' (logprobs/logprobs_sm90.h)
    "sm90_logprobs_fold": "PYKERNELS_SM90_LOGPROBS_FOLD",  # their statistics epilogue's (the same file)
    "sm90_raster": "PYKERNELS_SM90_RASTER",  # the core's tile order (common/sm90_tile_order.h)
    "sm90_dense": "PYKERNELS_SM90_DENSE",  # the core's kernel for a dense GEMM (common/sm90_dense_plain.h)
    "sm90_lora_forward": "PYKERNELS_SM90_LORA",  # the LoRA forward's GEMM (lora/lora_extended_k.h)
    "sm90_lora_grad_x": "PYKERNELS_SM90_LORA_GRAD_X",  # its grad_x's (lora/lora_extended_k.h)
    "lora_rank_gemm": "PYKERNELS_LORA_RANK_GEMM",  # its rank products (lora/lora_rank_pieces.h)
    "nf4_chunk_mib": "PYKERNELS_NF4_CHUNK_MIB",  # the QLoRA GEMMs' chunks of W (lora/nf4_chunks.h)
    "sm90_nf4_forward": "PYKERNELS_SM90_NF4",  # the QLoRA forward's GEMM (nf4/nf4_gemm_sm90.h)
    "sm90_moe_lora": "PYKERNELS_SM90_MOE_LORA",  # the experts' LoRA products (moe/moe.h)
    "sm90_moe_act": "PYKERNELS_SM90_MOE_ACT",  # the experts' activation (pykernels/ops/moe.py)
    "sm90_moe_gather": "PYKERNELS_SM90_MOE_GATHER",  # their rows by token (moe/moe.h)
    "moe_rank_tile": "PYKERNELS_MOE_RANK_TILE",  # their LoRA rank products' tile (moe/moe.h)
    "nf4_dequantize": "PYKERNELS_NF4_DEQUANT",  # the NF4 dequantize kernel (nf4/nf4.h)
}


def identity(device: torch.device) -> dict:
    device = torch.device(device)
    if str(device) not in _identities:
        _identities[str(device)] = {
            "device": device_name(device), "driver": _driver_version() if device.type == "cuda" else "none",
            "torch": torch.__version__, "pykernels": pykernels.__version__, "extension": _extension_stamp(),
            # PYKERNELS_SM90=0 swaps the Hopper GEMMs for the sm80 kernels (csrc/common/gemm_sm90_torch.h)
            "sm90_kernels": os.environ.get("PYKERNELS_SM90") != "0",
            **{name: os.environ.get(variable) or "default" for name, variable in KERNEL_KNOBS.items()}}
    return _identities[str(device)]


def _key(ident: dict) -> str:
    return json.dumps(ident, sort_keys=True)


def _read() -> dict[str, dict]:
    path = cache_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"not a format-{FORMAT} dispatch cache")
        return {key: {"decisions": dict(entry["decisions"]), "disabled": dict(entry["disabled"])}
                for key, entry in data["entries"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        if str(path) not in _warned_corrupt:
            _warned_corrupt.add(str(path))
            warnings.warn(f"pykernels: ignoring unreadable dispatch cache {path} ({error}); kernels will be "
                          "re-checked and the file rewritten", RuntimeWarning, stacklevel=2)
        return {}


def _entry(device: torch.device) -> dict:
    global _entries
    if _entries is None:
        _entries = _read()
    key = _identity_keys.get(str(device))
    if key is None:
        key = _identity_keys[str(device)] = _key(identity(device))
    return _entries.setdefault(key, {"decisions": {}, "disabled": {}})


def lookup(device: torch.device, bucket: str) -> dict | None:
    return _entry(device)["decisions"].get(bucket)


def disabled(device: torch.device, op: str) -> str | None:
    """Why ``op``'s kernel is disabled on this device and these versions, or None."""
    return _entry(device)["disabled"].get(op)


def record(device: torch.device, bucket: str, decision: dict, disable_op: str | None = None) -> None:
    entry = _entry(device)
    entry["decisions"][bucket] = decision
    if disable_op is not None:
        entry["disabled"][disable_op] = decision.get("reason", "disagrees with torch")
    _write(identity(device), entry)


def _write(ident: dict, entry: dict) -> None:
    """Merge into what is on disk now (other processes decide too), drop this device's stale
    identities, replace the file atomically."""
    path = cache_path()
    on_disk = _read()
    old = on_disk.get(_key(ident), {"decisions": {}, "disabled": {}})
    entries = {key: value for key, value in on_disk.items() if json.loads(key).get("device") != ident["device"]}
    merged = {"decisions": {**old["decisions"], **entry["decisions"]},
              "disabled": {**old["disabled"], **entry["disabled"]}}
    entries[_key(ident)] = merged
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".dispatch-", suffix=".json",
                                         delete=False) as handle:
            json.dump({"format": FORMAT, "entries": entries}, handle, indent=1, sort_keys=True)
        os.replace(handle.name, path)
    except OSError as error:  # a read-only home must not stop training: the choice still holds in memory
        logger.warning("pykernels: cannot write the dispatch cache %s (%s)", path, error)


def forget() -> None:
    """Drop what this process remembers (the next lookup reads the file again): for tests, and
    after changing PYKERNELS_CACHE."""
    global _entries
    _entries = None
    _identities.clear()
    _identity_keys.clear()
    _warned_corrupt.clear()
