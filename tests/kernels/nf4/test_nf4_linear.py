"""NF4Linear: matches bitsandbytes' Linear4bit, keeps only the packed weight for backward."""

import bitsandbytes as bnb
import pytest
import torch

import pykernels.nf4 as nf4
from pykernels.nn import NF4Linear, nf4_linear

# (dtype, atol, rtol) against an fp64 matmul of the same dequantized weight
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 3e-2, 2e-2), (torch.float16, 3e-3, 3e-3)]


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape", [(1, 769), (7, 769), (2, 3, 769)])
def test_forward_and_backward_match_fp64(x_shape, bias, dtype, atol, rtol):
    torch.manual_seed(0)
    linear = torch.nn.Linear(769, 83, bias=bias).to(dtype)
    if bias:
        linear.bias.requires_grad_(True)
    layer = NF4Linear.from_linear(linear, blocksize=64, double_quant=True)
    x = torch.randn(x_shape, dtype=dtype, requires_grad=True)
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)

    weight64 = nf4.dequantize(layer.weight).double()  # the weight the layer multiplies by
    x64 = x.detach().double()
    expected = x64 @ weight64.T + (layer.bias.detach().double() if bias else 0)
    torch.testing.assert_close(y.double(), expected, atol=atol, rtol=rtol)
    torch.testing.assert_close(x.grad.double(), grad_y.double() @ weight64, atol=atol, rtol=rtol)
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), grad_y.double().reshape(-1, 83).sum(0),
                                   atol=atol, rtol=rtol)


def test_matches_bitsandbytes_linear4bit():
    torch.manual_seed(0)
    theirs = bnb.nn.Linear4bit(256, 96, compress_statistics=True, quant_type="nf4", compute_dtype=torch.float32)
    theirs = theirs.to("cpu")
    ours = NF4Linear.from_bnb(theirs)
    x = torch.randn(5, 256, requires_grad=True)
    x_bnb = x.detach().clone().requires_grad_(True)
    y = ours(x)
    y_bnb = theirs.train()(x_bnb)
    torch.testing.assert_close(y, y_bnb, atol=1e-5, rtol=1e-5)
    y.sum().backward()
    y_bnb.sum().backward()
    torch.testing.assert_close(x.grad, x_bnb.grad, atol=1e-5, rtol=1e-5)


def test_backward_does_not_keep_the_dense_weight():
    layer = NF4Linear.from_linear(torch.nn.Linear(1024, 512))
    saved_numels = []

    def pack(tensor):
        saved_numels.append(tensor.numel())
        return tensor

    x = torch.randn(4, 1024, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert 512 * 1024 not in saved_numels, "the dequantized weight was saved for backward"
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_weight_is_frozen_and_not_a_parameter():
    layer = NF4Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    assert list(layer.parameters()) == []
    assert layer.weight.shape == (32, 64)


def test_compile_forward_and_backward():
    torch._dynamo.reset()
    layer = NF4Linear.from_linear(torch.nn.Linear(256, 64))
    x = torch.randn(3, 256, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    expected_x = x.detach().clone().requires_grad_(True)
    expected = layer(expected_x)
    expected.sum().backward()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(x.grad, expected_x.grad)


def test_module_moves_with_to():
    layer = NF4Linear.from_linear(torch.nn.Linear(64, 32)).to(torch.device("cpu"))
    assert layer.weight.device.type == "cpu"


def test_bad_input_shapes_are_named():
    layer = NF4Linear.from_linear(torch.nn.Linear(64, 32))
    with pytest.raises(ValueError, match=r"x must have in_features = 64 as its last dimension, got shape \(2, 63\)"):
        layer(torch.randn(2, 63))
    with pytest.raises(ValueError, match=r"weight must be a 2-D NF4Weight"):
        nf4_linear(torch.randn(2, 64), nf4.quantize(torch.randn(2, 4, 64)))
    with pytest.raises(ValueError, match=r"bias must have shape \(32,\), got \(31,\)"):
        NF4Linear(nf4.quantize(torch.randn(32, 64)), torch.zeros(31))


def test_is_an_nn_linear_and_dtype_casts_leave_the_quantized_weight_alone():
    layer = NF4Linear.from_linear(torch.nn.Linear(128, 64), double_quant=True)
    assert isinstance(layer, torch.nn.Linear)
    before = {name: tensor.clone() for name, tensor in layer.weight.tensors().items()}
    layer = layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    for name, tensor in layer.weight.tensors().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name


def test_peft_wraps_nf4linear_and_trains_only_the_adapter():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("proj", NF4Linear.from_linear(torch.nn.Linear(64, 32)))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False))
    x = torch.randn(3, 64)
    y = peft_model(x)
    lora = peft_model.base_model.model.proj
    expected = layer_output = lora.base_layer(x)
    expected = layer_output + (lora.scaling["default"] * (x @ lora.lora_A["default"].weight.T)
                               @ lora.lora_B["default"].weight.T)
    torch.testing.assert_close(y, expected)
    y.sum().backward()
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert all(p.grad is not None for name, p in peft_model.named_parameters() if p.requires_grad)
