"""bitsandbytes Linear4bit serialization: byte-identical keys, safetensors round trips, loading
checkpoints written by bitsandbytes, and clear errors for state dicts we cannot read."""

import bitsandbytes as bnb
import bitsandbytes.functional as F
import bnb_oracle
import pytest
import torch
from safetensors.torch import load_file, save_file

import pykernels.nf4 as nf4
from pykernels.nf4_weight import QUANT_STATE_SUFFIX, NF4Weight
from pykernels.nn import NF4Linear

CASES = [((70, 130), torch.float32, 64), ((256, 512), torch.bfloat16, 128), ((33, 7), torch.float16, 32),
         ((4096,), torch.bfloat16, 4096)]


def bnb_state_dict(x: torch.Tensor, blocksize: int, double_quant: bool, prefix: str = "weight") -> dict:
    """What bitsandbytes' Linear4bit._save_to_state_dict writes for this weight."""
    packed, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4")
    entries = {prefix: packed}
    entries.update({f"{prefix}.{k}": v for k, v in state.as_dict(packed=True).items()})
    return entries


def assert_same_entries(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,dtype,blocksize", CASES)
def test_to_bnb_state_dict_is_byte_identical(shape, dtype, blocksize, double_quant):
    x = torch.randn(shape).to(dtype)
    ours = nf4.quantize(x, blocksize, double_quant).to_bnb_state_dict("model.layers.0.mlp.up_proj.weight")
    assert_same_entries(ours, bnb_state_dict(x, blocksize, double_quant, "model.layers.0.mlp.up_proj.weight"))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,dtype,blocksize", CASES)
def test_safetensors_round_trip(tmp_path, shape, dtype, blocksize, double_quant):
    w = nf4.quantize(torch.randn(shape).to(dtype), blocksize, double_quant)
    save_file(w.to_bnb_state_dict("w"), tmp_path / "w.safetensors")
    loaded = NF4Weight.from_bnb_state_dict(load_file(tmp_path / "w.safetensors"), "w")
    assert ((loaded.shape, loaded.dtype, loaded.blocksize, loaded.double_quant)
            == (w.shape, w.dtype, blocksize, double_quant))
    for name, tensor in w.tensors().items():
        assert torch.equal(getattr(loaded, name), tensor), name
    assert torch.equal(nf4.dequantize(loaded), nf4.dequantize(w))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,dtype,blocksize", CASES)
def test_loads_checkpoint_saved_by_bitsandbytes(tmp_path, shape, dtype, blocksize, double_quant):
    x = torch.randn(shape).to(dtype)
    save_file(bnb_state_dict(x, blocksize, double_quant), tmp_path / "bnb.safetensors")
    loaded = NF4Weight.from_bnb_state_dict(load_file(tmp_path / "bnb.safetensors"))
    packed, state = F.quantize_4bit(x, blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4")
    assert torch.equal(nf4.dequantize(loaded), bnb_oracle.dequantize(packed, state))


def test_bitsandbytes_reads_our_checkpoint(tmp_path):
    x = torch.randn(96, 200, dtype=torch.bfloat16)
    save_file(nf4.quantize(x, 64, True).to_bnb_state_dict(), tmp_path / "ours.safetensors")
    state_dict = load_file(tmp_path / "ours.safetensors")
    stats = {k.removeprefix("weight."): v for k, v in state_dict.items() if k != "weight"}
    params = bnb.nn.Params4bit.from_prequantized(state_dict["weight"], stats, device="cpu")
    packed, state = F.quantize_4bit(x, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(bnb_oracle.dequantize(params.data, params.quant_state), bnb_oracle.dequantize(packed, state))


def test_non_uint8_quant_storage_is_read_as_bytes():
    x = torch.randn(64, 128)
    entries = bnb_state_dict(x, 64, True)
    entries["weight"] = entries["weight"].reshape(-1).view(torch.bfloat16).unsqueeze(1)  # quant_storage=bf16 (FSDP)
    assert torch.equal(nf4.dequantize(NF4Weight.from_bnb_state_dict(entries)),
                       nf4.dequantize(nf4.quantize(x, 64, True)))


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4linear_state_dict_matches_linear4bit(double_quant):
    torch.manual_seed(0)
    linear = torch.nn.Linear(130, 70)
    theirs = bnb.nn.Linear4bit(130, 70, compress_statistics=double_quant, quant_type="nf4")
    theirs.load_state_dict(linear.state_dict())
    theirs = theirs.to("cpu")  # bitsandbytes quantizes on the move to a device
    ours = NF4Linear.from_linear(linear, blocksize=64, double_quant=double_quant)
    assert_same_entries(ours.state_dict(), theirs.state_dict())


def test_nf4linear_loads_linear4bit_state_dict_and_from_bnb():
    torch.manual_seed(0)
    theirs = bnb.nn.Linear4bit(64, 48, compress_statistics=True, quant_type="nf4")
    theirs = theirs.to("cpu")
    target = NF4Linear.from_linear(torch.nn.Linear(64, 48))
    target.load_state_dict(theirs.state_dict())
    expected = bnb_oracle.dequantize(theirs.weight.data, theirs.weight.quant_state)
    assert torch.equal(nf4.dequantize(target.weight), expected)
    assert torch.equal(nf4.dequantize(NF4Linear.from_bnb(theirs).weight), expected)
    assert torch.equal(target.bias, theirs.bias)


def test_nf4linear_load_reports_shape_mismatch():
    small = NF4Linear.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(RuntimeError, match=r"checkpoint shape \(32, 64\) does not match \(48, 64\)"):
        NF4Linear.from_linear(torch.nn.Linear(64, 48)).load_state_dict(small.state_dict())


# ---------------------------------------------------------------- unreadable state dicts
def test_missing_weight_key():
    with pytest.raises(KeyError, match="state dict has no 'layer.weight' entry"):
        NF4Weight.from_bnb_state_dict({}, "layer.weight")


def test_missing_quant_state():
    entries = bnb_state_dict(torch.randn(64), 64, False)
    del entries["weight." + QUANT_STATE_SUFFIX]
    with pytest.raises(ValueError,
                       match="expected exactly one quant state 'weight.quant_state.bitsandbytes__nf4', found none"):
        NF4Weight.from_bnb_state_dict(entries)


def test_fp4_is_rejected():
    packed, state = F.quantize_4bit(torch.randn(64), blocksize=64, quant_type="fp4")
    entries = {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    with pytest.raises(ValueError, match=r"found \['weight.quant_state.bitsandbytes__fp4'\] \(only NF4"):
        NF4Weight.from_bnb_state_dict(entries)


def test_wrong_quant_map_is_rejected():
    entries = bnb_state_dict(torch.randn(64), 64, False)
    entries["weight.quant_map"] = entries["weight.quant_map"].flip(0)
    with pytest.raises(ValueError, match="'weight.quant_map' is not the NF4 code book"):
        NF4Weight.from_bnb_state_dict(entries)


def test_truncated_absmax_is_named():
    entries = bnb_state_dict(torch.randn(640), 64, False)
    entries["weight.absmax"] = entries["weight.absmax"][:-1]
    with pytest.raises(ValueError, match="NF4Weight.absmax must have 10 elements, got 9"):
        NF4Weight.from_bnb_state_dict(entries)
