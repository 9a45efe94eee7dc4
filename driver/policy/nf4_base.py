"""The base a QLoRA adapter is trained against, as a checkpoint an engine can load: every weight the
trainer quantizes replaced by dequantize(quantize(W)) with pykernels' NF4 kernels, in the trainer's
dtype, blocksize and double quantization; everything else as it is.

vLLM serving this base with the adapter computes what the trainer computes (up to kernel arithmetic),
so the importance weights correct only the engine's numerics, not a different base. Built once per
(model files, blocksize, double quantization, dtype) into a cache and reused by later runs.

Written shard by shard: each output shard holds the same tensors as its input shard, read lazily
(safetensors), so the peak is about one shard, plus one MoE layer's experts. Experts are quantized by
the trainer as the fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj transformers builds (double
quantization's scales depend on the whole tensor), so a checkpoint that stores them per expert
(`experts.<e>.gate_proj / up_proj / down_proj.weight`, Qwen3-MoE's) has each layer's experts fused,
round-tripped and split back (gate_up_proj[e] = cat(gate_proj[e], up_proj[e]) by rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from driver.data.tiny_model import cache_root

# Layers QLoRA leaves in full precision (load_policy's quantize_linears): the output head and MoE routers.
UNQUANTIZED_SUFFIXES = ("lm_head", ".gate", ".router")
FORMAT_VERSION = 1  # bump when what is written changes: older cache entries are then rebuilt
PER_EXPERT = re.compile(r"^(?P<module>.+)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class QuantizedTensors:
    """Checkpoint names of what QLoRA quantizes in one model."""

    linears: set[str] = field(default_factory=set)  # "<module>.weight" of every quantized nn.Linear
    experts: set[str] = field(default_factory=set)  # "<...>.experts" modules whose projections are quantized


def meta_model(model_dir: str) -> nn.Module:
    """model_dir's architecture on the meta device: its modules and shapes, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def quantized_tensors(model: nn.Module) -> QuantizedTensors:
    """What load_policy quantizes for model.qlora in `model` (unquantized; meta_model's will do)."""
    from pykernels.integrations.transformers import quantizable_experts

    names = {id(module): name for name, module in model.named_modules()}
    linears = {f"{name}.weight" for name, module in model.named_modules()
               if type(module) is nn.Linear and not name.endswith(UNQUANTIZED_SUFFIXES)}
    return QuantizedTensors(linears, {names[id(experts)] for experts in quantizable_experts(model)})


def roundtrip(weight: torch.Tensor, blocksize: int, double_quant: bool = True) -> torch.Tensor:
    """dequantize(quantize(weight)) in weight's dtype: what an NF4 layer computes with."""
    from pykernels.nf4 import quantize

    return quantize(weight, blocksize=blocksize, double_quant=double_quant).dequantize(weight.dtype)


def nf4_base(model_dir: str, dtype: torch.dtype, blocksize: int, double_quant: bool = True) -> Path:
    """The round-tripped base of model_dir in the cache, built now if it is not there yet."""
    fingerprint = _fingerprint(model_dir, dtype, blocksize, double_quant)
    target = cache_root() / "nf4-bases" / f"{Path(model_dir).name}-{fingerprint}"
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write_nf4_base(Path(model_dir), staging, dtype, blocksize, double_quant)
        staging.rename(target)  # atomic: a crash leaves no half-written base where a run would take it
    except OSError:
        if not (target / "config.json").is_file():  # not another process that finished first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_nf4_base(source: Path, out: Path, dtype: torch.dtype, blocksize: int, double_quant: bool) -> None:
    quantized = quantized_tensors(meta_model(str(source)))

    def linear(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return roundtrip(tensor.to(dtype), blocksize, double_quant) if name in quantized.linears else tensor

    def experts(module: str, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(roundtrip(fused.to(dtype), blocksize, double_quant) for fused in (gate_up, down))

    rewrite_checkpoint(source, out, linear, experts, quantized.experts)


def rewrite_checkpoint(source: Path, out: Path, linear: Callable[[str, torch.Tensor], torch.Tensor],
                       experts: Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                       expert_modules: set[str]) -> None:
    """source's checkpoint into out, shard by shard: linear(name, tensor) maps every tensor that is not
    an expert projection of `expert_modules`; experts(module, gate_up_proj, down_proj) maps a layer's
    experts in the fused layout ([E, 2I, H], [E, H, I]), however the checkpoint stores them. Other files
    (config, tokenizer, the shard index) are copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{source} holds no .safetensors weights")
    location = {}
    for shard in shards:
        with safe_open(shard, "pt") as handle:
            location.update(dict.fromkeys(handle.keys(), shard))
    layers = _ExpertLayers(expert_modules, location, experts)
    for shard in shards:
        tensors = {}
        with safe_open(shard, "pt") as handle:
            metadata = handle.metadata()
            for name in handle.keys():
                tensor = layers.take(name) if layers.owns(name) else linear(name, handle.get_tensor(name))
                tensors[name] = tensor.contiguous()
        save_file(tensors, out / shard.name, metadata=metadata)
        del tensors
    if layers.pending:
        raise ValueError(f"{source}: expert weights {sorted(layers.pending)[:3]} were computed but never written")
    for extra in source.iterdir():  # config, tokenizer, generation config, the shard index
        if extra.is_file() and extra.suffix != ".safetensors":
            shutil.copy2(extra, out / extra.name)


class _ExpertLayers:
    """Each layer's experts, mapped in the fused layout when its first tensor is written and kept until
    its last one is."""

    def __init__(self, modules: set[str], location: dict[str, Path], transform) -> None:
        self.modules, self.location, self.transform = modules, location, transform
        self.pending: dict[str, torch.Tensor] = {}  # checkpoint name -> mapped tensor, not yet written

    def owns(self, name: str) -> bool:
        match = PER_EXPERT.match(name)
        if match is not None:
            return match["module"] in self.modules
        module, _, proj = name.rpartition(".")
        return module in self.modules and proj in ("gate_up_proj", "down_proj")  # stored fused already

    def take(self, name: str) -> torch.Tensor:
        if name not in self.pending:
            match = PER_EXPERT.match(name)
            self.pending.update(self._per_expert(match["module"]) if match is not None else
                                self._fused(name.rpartition(".")[0]))
        return self.pending.pop(name)

    def _read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.location[name], "pt") as handle:
            return handle.get_tensor(name)

    def _fused(self, module: str) -> dict[str, torch.Tensor]:
        gate_up, down = self.transform(module, self._read(f"{module}.gate_up_proj"), self._read(f"{module}.down_proj"))
        return {f"{module}.gate_up_proj": gate_up, f"{module}.down_proj": down}

    def _per_expert(self, module: str) -> dict[str, torch.Tensor]:
        count = 1 + max(int(m["expert"]) for name in self.location
                        if (m := PER_EXPERT.match(name)) is not None and m["module"] == module)
        gate_up = torch.stack([torch.cat([self._read(f"{module}.{e}.gate_proj.weight"),
                                          self._read(f"{module}.{e}.up_proj.weight")]) for e in range(count)])
        down = torch.stack([self._read(f"{module}.{e}.down_proj.weight") for e in range(count)])
        gate_up, down = self.transform(module, gate_up, down)
        rows = gate_up.shape[1] // 2
        split = {}
        for e in range(count):
            split[f"{module}.{e}.gate_proj.weight"] = gate_up[e, :rows]
            split[f"{module}.{e}.up_proj.weight"] = gate_up[e, rows:]
            split[f"{module}.{e}.down_proj.weight"] = down[e]
        return split


def _fingerprint(model_dir: str, dtype: torch.dtype, blocksize: int, double_quant: bool) -> str:
    """Changes when the model's files, the quantization settings or this module's output change."""
    files = sorted((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in Path(model_dir).iterdir()
                   if path.is_file())
    key = json.dumps([str(Path(model_dir).resolve()), files, str(dtype), blocksize, double_quant, FORMAT_VERSION])
    return hashlib.sha256(key.encode()).hexdigest()[:12]
