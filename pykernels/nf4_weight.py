"""NF4Weight: a tensor quantized to NF4, and bitsandbytes Linear4bit serialization.

bitsandbytes stores a 4-bit weight under its key (uint8, shape [ceil(numel/2), 1]) plus
``<key>.absmax``, ``<key>.quant_map``, optional ``<key>.nested_absmax`` /
``<key>.nested_quant_map`` and ``<key>.quant_state.bitsandbytes__nf4`` (JSON bytes holding
blocksize, dtype, shape and the nested statistics). We read and write exactly that layout, so
checkpoints move between transformers/bitsandbytes and pykernels without re-quantizing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from pykernels.nf4_format import BLOCKSIZES, NESTED_BLOCKSIZE, nf4_code, num_blocks

QUANT_STATE_SUFFIX = "quant_state.bitsandbytes__nf4"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class NF4Weight:
    """A tensor quantized to NF4 (see ``pykernels.nf4.quantize``).

    Without double quantization ``absmax`` holds one fp32 scale per block. With it, ``absmax`` is
    None and the scales are ``nested_code[absmax_q] * nested_absmax[block // 256] +
    nested_offset``.
    """

    packed: torch.Tensor  # uint8 [ceil(numel / 2)]: the bytes of bitsandbytes' quantize_4bit
    shape: torch.Size  # shape of the original tensor
    dtype: torch.dtype  # dtype of the original tensor (the default dequantize dtype)
    blocksize: int
    absmax: torch.Tensor | None = None  # fp32 [num_blocks]
    absmax_q: torch.Tensor | None = None  # uint8 [num_blocks]
    nested_absmax: torch.Tensor | None = None  # fp32 [ceil(num_blocks / nested_blocksize)]
    nested_offset: torch.Tensor | None = None  # fp32 0-d: mean of the fp32 absmax
    nested_code: torch.Tensor | None = None  # fp32 [256]: the signed dynamic 8-bit map
    nested_blocksize: int = field(default=NESTED_BLOCKSIZE)

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"NF4Weight.blocksize must be one of {BLOCKSIZES}, got {self.blocksize}")
        numel = self.shape.numel()
        blocks = num_blocks(numel, self.blocksize)
        _expect(self.packed, "packed", torch.uint8, (numel + 1) // 2)
        if self.double_quant:
            if self.absmax is not None:
                raise ValueError("NF4Weight: give absmax or absmax_q (double quantization), not both")
            missing = [
                name
                for name in ("nested_absmax", "nested_offset", "nested_code")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"NF4Weight: absmax_q needs {', '.join(missing)}")
            _expect(self.absmax_q, "absmax_q", torch.uint8, blocks)
            _expect(self.nested_absmax, "nested_absmax", torch.float32,
                    num_blocks(blocks, self.nested_blocksize))
            _expect(self.nested_offset, "nested_offset", torch.float32, 1)
            _expect(self.nested_code, "nested_code", torch.float32, 256)
        else:
            if self.absmax is None:
                raise ValueError("NF4Weight: absmax (or absmax_q with nested statistics) is required")
            _expect(self.absmax, "absmax", torch.float32, blocks)

    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def numel(self) -> int:
        return self.shape.numel()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that make up this weight, by field name."""
        names = ("packed", "absmax", "absmax_q", "nested_absmax", "nested_offset", "nested_code")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> NF4Weight:
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def dequantize(self, dtype: torch.dtype | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        from pykernels.nf4 import dequantize  # dispatched (pykernels/dispatch.py)

        return dequantize(self, dtype, out=out)

    # ------------------------------------------------------------------ bitsandbytes format
    def to_bnb_state_dict(self, prefix: str = "weight") -> dict[str, torch.Tensor]:
        """State-dict entries of a bitsandbytes Linear4bit weight stored under ``prefix``."""
        key = prefix + "."
        state = {prefix: self.packed.reshape(-1, 1)}
        state[key + "absmax"] = self.absmax_q if self.double_quant else self.absmax
        state[key + "quant_map"] = nf4_code(self.device)
        metadata = {
            "quant_type": "nf4",
            "blocksize": self.blocksize,
            "dtype": _dtype_name(self.dtype),
            "shape": list(self.shape),
        }
        if self.double_quant:
            state[key + "nested_absmax"] = self.nested_absmax
            state[key + "nested_quant_map"] = self.nested_code.clone()
            metadata["nested_blocksize"] = self.nested_blocksize
            metadata["nested_dtype"] = "float32"
            metadata["nested_offset"] = self.nested_offset.item()
        state[key + QUANT_STATE_SUFFIX] = torch.tensor(
            list(json.dumps(metadata).encode("utf-8")), dtype=torch.uint8, device=self.device
        )
        return state

    @classmethod
    def from_bnb_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], prefix: str = "weight"
    ) -> NF4Weight:
        """Read a bitsandbytes Linear4bit weight stored under ``prefix`` (no re-quantization)."""
        key = prefix + "."
        if prefix not in state_dict:
            raise KeyError(f"state dict has no '{prefix}' entry (the packed NF4 weight)")
        quant_state_keys = sorted(k for k in state_dict if k.startswith(key + "quant_state."))
        if quant_state_keys != [key + QUANT_STATE_SUFFIX]:
            raise ValueError(
                f"expected exactly one quant state '{key}{QUANT_STATE_SUFFIX}', found "
                f"{quant_state_keys or 'none'} (only NF4, not FP4, is supported)"
            )
        metadata = json.loads(bytes(state_dict[key + QUANT_STATE_SUFFIX].cpu().tolist()).decode())
        if metadata.get("quant_type") != "nf4":
            raise ValueError(f"'{key}{QUANT_STATE_SUFFIX}' has quant_type "
                             f"{metadata.get('quant_type')!r}; only 'nf4' is supported")
        for name in ("absmax", "quant_map"):
            if key + name not in state_dict:
                raise KeyError(f"state dict has no '{key}{name}'")
        quant_map = state_dict[key + "quant_map"]
        if not torch.equal(quant_map.detach().float().cpu(), nf4_code()):
            raise ValueError(f"'{key}quant_map' is not the NF4 code book")
        if metadata.get("dtype") not in _DTYPES:
            raise ValueError(f"'{key}{QUANT_STATE_SUFFIX}' has unsupported dtype {metadata.get('dtype')!r}")
        packed = state_dict[prefix].detach().contiguous().view(torch.uint8).reshape(-1)
        common = dict(
            packed=packed,
            shape=torch.Size(metadata["shape"]),
            dtype=_DTYPES[metadata["dtype"]],
            blocksize=int(metadata["blocksize"]),
        )
        absmax = state_dict[key + "absmax"].detach()
        if key + "nested_absmax" not in state_dict:
            return cls(absmax=absmax, **common)
        if key + "nested_quant_map" not in state_dict:
            raise KeyError(f"state dict has '{key}nested_absmax' but no '{key}nested_quant_map'")
        return cls(
            absmax_q=absmax,
            nested_absmax=state_dict[key + "nested_absmax"].detach(),
            nested_code=state_dict[key + "nested_quant_map"].detach(),
            nested_offset=torch.tensor(
                float(metadata["nested_offset"]), dtype=torch.float32, device=packed.device
            ),
            nested_blocksize=int(metadata.get("nested_blocksize", NESTED_BLOCKSIZE)),
            **common,
        )

    @classmethod
    def from_bnb_params(cls, weight: torch.Tensor) -> NF4Weight:
        """Wrap a bitsandbytes ``Params4bit`` (``Linear4bit.weight``) without re-quantizing."""
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            raise ValueError("weight has no quant_state: it is not a quantized bitsandbytes Params4bit")
        if getattr(quant_state, "packing_format_for_cpu", False):
            raise ValueError(
                "this Params4bit was repacked by bitsandbytes for its CPU inference kernel; "
                "save and reload its state_dict (which restores the standard layout) first"
            )
        state = {"weight": weight.data}
        state.update({"weight." + k: v for k, v in quant_state.as_dict(packed=True).items()})
        return cls.from_bnb_state_dict(state, "weight")


def _expect(tensor: torch.Tensor | None, name: str, dtype: torch.dtype, numel: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"NF4Weight.{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"NF4Weight.{name} must be {dtype}, got {tensor.dtype}")
    if tensor.numel() != numel:
        raise ValueError(
            f"NF4Weight.{name} must have {numel} elements, got {tensor.numel()} "
            f"(shape {tuple(tensor.shape)})"
        )
