"""Merge a trained LoRA adapter into its base: `python -m driver.merge_lora <run dir | adapter dir> --out DIR`
(also `pykernels-merge-lora`).

Shard by shard (driver/policy/nf4_base.py's rewrite_checkpoint: the peak is about one shard plus one
MoE layer's experts): every adapted weight becomes W + scaling x B A, in float32, cast back to the
base's dtype, with the base's shard names, index and config; the tokenizer and the other small files
are copied. LoRA on linears (PEFT target_modules) and on fused MoE experts (PEFT target_parameters on
gate_up_proj / down_proj: per expert B_e A_e), rsLoRA scaling (alpha / sqrt(r)). A QLoRA adapter was
trained against the NF4 round trip of the base, not the base: --simulate-nf4 merges into
dequantize(quantize(W)) for every weight QLoRA quantizes, --simulate-nf4-experts for the experts only;
a run directory whose config has model.qlora defaults to --simulate-nf4 with its blocksize (double
quantization, as trained). Refused with a message: DoRA, LoRA biases, rank or alpha patterns, and
adapter types other than LoRA (AdaLoRA, LoHa, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from driver.cli import ConfigError
from driver.data.adapter_settings import beyond_plain_lora
from driver.data.model_source import model_directory
from driver.policy.nf4_base import meta_model, quantized_tensors, rewrite_checkpoint, roundtrip

ADAPTER_KEY = re.compile(r"^base_model\.model\.(?P<module>.+?)(?P<nested>(\.base_layer)*)\.lora_(?P<ab>[AB])\.weight$")


@dataclass
class NF4Simulation:
    linears: bool  # round-trip every quantized linear
    experts: bool  # round-trip the quantized experts
    blocksize: int = 64
    double_quant: bool = True
    dtype: torch.dtype | None = None  # the trainer's (it quantized in it); None: the checkpoint's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m driver.merge_lora", description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a run's output directory (with adapter/ and config.yaml) or an "
                        "adapter directory (adapter_config.json)")
    parser.add_argument("--out", type=Path, required=True, help="directory of the merged model (must not exist, "
                        "or be empty)")
    parser.add_argument("--base", help="the base model directory (default: the run's model.path, or the adapter's "
                        "base_model_name_or_path)")
    nf4 = parser.add_mutually_exclusive_group()
    nf4.add_argument("--simulate-nf4", action="store_true", default=None,
                     help="merge into the NF4 round trip of every weight QLoRA quantizes (default for a QLoRA run)")
    nf4.add_argument("--simulate-nf4-experts", action="store_true", help="round-trip the MoE experts only")
    nf4.add_argument("--no-simulate-nf4", dest="simulate_nf4", action="store_false",
                     help="merge into the base as it is, even for a QLoRA run")
    parser.add_argument("--blocksize", type=int,
                        help="NF4 block size (default: the run's model.qlora_blocksize, or 64)")
    args = parser.parse_args(argv)
    try:
        out = merge(args.source, args.out, base=args.base, simulate_nf4=args.simulate_nf4,
                    simulate_nf4_experts=args.simulate_nf4_experts, blocksize=args.blocksize)
    except (ConfigError, OSError, ValueError) as error:  # what the user can fix: no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"merged into {out}")
    return 0


def merge(source: Path, out: Path, *, base: str | None = None, simulate_nf4: bool | None = None,
          simulate_nf4_experts: bool = False, blocksize: int | None = None) -> Path:
    adapter_dir, run_config = _locate(Path(source))
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    _check_supported(adapter_config, adapter_dir)
    model = run_config.get("model", {})
    qlora = bool(model.get("qlora", False))
    base_dir = Path(model_directory(base or model.get("path") or adapter_config["base_model_name_or_path"],
                                    None if base else model.get("revision", adapter_config.get("revision"))))
    if simulate_nf4 is None:
        simulate_nf4 = qlora and not simulate_nf4_experts
    from driver.policy.model import DTYPES

    simulation = NF4Simulation(linears=simulate_nf4, experts=simulate_nf4 or simulate_nf4_experts,
                               blocksize=blocksize or model.get("qlora_blocksize", 64),
                               dtype=DTYPES[model["dtype"]] if "dtype" in model else None)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    write_merged(base_dir, adapter_dir, adapter_config, out, simulation)
    return out


def write_merged(base_dir: Path, adapter_dir: Path, adapter_config: dict, out: Path,
                 simulation: NF4Simulation) -> None:
    from safetensors.torch import load_file

    architecture = meta_model(str(base_dir))
    quantized = quantized_tensors(architecture)
    deltas = LoraDeltas(load_file(adapter_dir / "adapter_model.safetensors"), adapter_config, architecture)

    def nf4(tensor: torch.Tensor) -> torch.Tensor:
        # The trainer quantized the weight in its training dtype; the round trip happens there.
        return roundtrip(tensor.to(simulation.dtype or tensor.dtype), simulation.blocksize, simulation.double_quant)

    def linear(name: str, tensor: torch.Tensor) -> torch.Tensor:
        dtype = tensor.dtype
        if simulation.linears and name in quantized.linears:
            tensor = nf4(tensor)
        delta = deltas.linear(name)
        if delta is None:
            return tensor.to(dtype)
        return (tensor.float() + delta).to(dtype)

    def experts(module: str, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        merged = []
        for proj, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            dtype = weight.dtype
            if simulation.experts and module in quantized.experts:
                weight = nf4(weight)
            delta = deltas.experts(module, proj, tuple(weight.shape))
            merged.append((weight.float() + delta).to(dtype) if delta is not None else weight.to(dtype))
        return merged[0], merged[1]

    modules = quantized.experts | deltas.expert_modules
    rewrite_checkpoint(base_dir, out, linear, experts, modules)
    unused = deltas.unused()
    if unused:
        raise ValueError(f"{adapter_dir}: adapter weights {unused[:3]} match no weight of {base_dir}")


class LoraDeltas:
    """scaling x B A per adapted weight, from PEFT's saved adapter (keys base_model.model.<module>...)."""

    def __init__(self, state: dict[str, torch.Tensor], config: dict, architecture: torch.nn.Module) -> None:
        """architecture: the base model's modules (meta_model), for the experts' layouts."""
        r, alpha = config["r"], config["lora_alpha"]
        self.scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        self.pairs: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (module, nesting) -> {A, B}
        for key, tensor in state.items():
            match = ADAPTER_KEY.match(key)
            if match is None:
                raise ValueError(f"adapter weight {key} is not a LoRA A or B matrix (PEFT's names)")
            self.pairs.setdefault((match["module"], match["nested"]), {})[match["ab"]] = tensor.float()
        self.expert_modules = {module for module, nested in self.pairs if module.endswith(".experts")}
        self.used: set[tuple[str, str]] = set()
        self.transposed = {name: bool(getattr(module, "is_transposed", False))
                           for name, module in architecture.named_modules() if name.endswith(".experts")}

    def linear(self, name: str) -> torch.Tensor | None:
        module = name.removesuffix(".weight")
        pair = self.pairs.get((module, ""))
        if pair is None or not name.endswith(".weight") or module in self.expert_modules:
            return None
        self.used.add((module, ""))
        return self.scaling * pair["B"] @ pair["A"]

    def experts(self, module: str, proj: str, shape: tuple[int, int, int]) -> torch.Tensor | None:
        """PEFT's ParamWrapper delta for a 3-D [E, out, in] parameter (in, out swapped when transposed).
        Two parameters of one module nest (the second wraps the first: .base_layer): each pair is matched
        to the parameter its shapes fit."""
        experts, rows, cols = shape
        out_features, in_features = (cols, rows) if self.transposed.get(module) else (rows, cols)
        found = [nested for (name, nested), pair in self.pairs.items() if name == module
                 and pair["A"].shape[1] == in_features and pair["A"].shape[0] % experts == 0
                 and pair["B"].shape == (out_features, pair["A"].shape[0])]
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{module}: the adapters of {proj} and of the other projection have the same shapes; "
                             "which is which cannot be told from the saved adapter")
        pair = self.pairs[(module, found[0])]
        self.used.add((module, found[0]))
        weight_a = pair["A"].reshape(experts, -1, in_features)  # e r i
        weight_b = pair["B"].reshape(out_features, -1, experts)  # o r e
        pattern = "o r e, e r i -> e i o" if self.transposed.get(module) else "o r e, e r i -> e o i"
        return torch.einsum(pattern, weight_b, weight_a) * self.scaling

    def unused(self) -> list[str]:
        return [f"{module}{nested}" for module, nested in self.pairs if (module, nested) not in self.used]


def _locate(source: Path) -> tuple[Path, dict]:
    """(the adapter directory, the run's config or {})."""
    import yaml

    if (source / "adapter_config.json").is_file():
        return source, {}
    if (source / "config.yaml").is_file():
        run_config = yaml.safe_load((source / "config.yaml").read_text()) or {}
        if run_config.get("model", {}).get("adapter") == "none":
            raise ConfigError(f"{source} is a full fine-tuning run: its model/ is already the merged model")
        if (source / "adapter" / "adapter_config.json").is_file():
            return source / "adapter", run_config
    raise FileNotFoundError(f"{source} is neither an adapter directory (adapter_config.json) nor a run directory "
                            "(config.yaml and adapter/)")


def _check_supported(config: dict, adapter_dir: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{adapter_dir}: a {config.get('peft_type')} adapter; merge_lora merges LoRA only")
    found = beyond_plain_lora(config)
    if found:
        raise ConfigError(f"{adapter_dir}: the adapter uses {', '.join(found)}, which merge_lora does not merge")


if __name__ == "__main__":
    sys.exit(main())
