"""NF4 ops: opcheck, torch.compile, and clear errors on bad input."""

from types import SimpleNamespace

import pytest
import torch

import pykernels.backend
import pykernels.nf4 as nf4
from pykernels import _extension
from pykernels._extension import ops
from pykernels.nf4_weight import NF4Weight
from pykernels.reference.nf4 import dynamic_map

OPCHECK_SHAPES = [(7,), (83,), (3, 769)]


def sample_weight(shape=(3, 769), dtype=torch.bfloat16, double_quant=False, blocksize=64) -> NF4Weight:
    return nf4.quantize(torch.randn(shape).to(dtype), blocksize=blocksize, double_quant=double_quant)


@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_opcheck_quantize(shape, dtype):
    torch.library.opcheck(ops.nf4_quantize, (torch.randn(shape).to(dtype), 64))


@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_opcheck_dequantize(shape, double_quant):
    w = sample_weight(shape, double_quant=double_quant)
    absmax = w.absmax_q if double_quant else w.absmax
    args = (w.packed, absmax, w.blocksize, list(w.shape), torch.float16,
            w.nested_absmax, w.nested_code, w.nested_offset, w.nested_blocksize)
    torch.library.opcheck(ops.nf4_dequantize, args)


@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_opcheck_dequantize_into(shape, double_quant):
    w = sample_weight(shape, double_quant=double_quant)
    absmax = w.absmax_q if double_quant else w.absmax
    args = (w.packed, absmax, w.blocksize, torch.empty(shape, dtype=torch.float16),
            w.nested_absmax, w.nested_code, w.nested_offset, w.nested_blocksize)
    torch.library.opcheck(ops.nf4_dequantize_into, args)


def test_opcheck_dynamic8():
    code = dynamic_map()
    x = torch.randn(1000)
    torch.library.opcheck(ops.dynamic8_quantize, (x, code, 256))
    q, absmax = ops.dynamic8_quantize(x, code, 256)
    torch.library.opcheck(ops.dynamic8_dequantize, (q, absmax, code, 256))


@pytest.mark.parametrize("double_quant", [False, True])
def test_compile_quantize_and_dequantize(double_quant):
    torch._dynamo.reset()

    def roundtrip(x):
        w = nf4.quantize(x, blocksize=64, double_quant=double_quant)
        return nf4.dequantize(w, torch.float32), w.packed

    x = torch.randn(5, 769, dtype=torch.bfloat16)
    compiled = torch.compile(roundtrip, fullgraph=True)
    expected, expected_packed = roundtrip(x)
    actual, actual_packed = compiled(x)
    assert torch.equal(actual_packed, expected_packed)
    assert torch.equal(actual, expected)


def test_compile_dequantize_into_a_buffer():
    torch._dynamo.reset()

    def into(w, buffer):
        nf4.dequantize(w, out=buffer)
        return buffer * 2

    w = sample_weight((5, 769), double_quant=True)
    compiled, buffer = torch.compile(into, fullgraph=True), torch.zeros(5, 769)
    assert torch.equal(compiled(w, buffer), nf4.dequantize(w, torch.float32) * 2)
    assert torch.equal(buffer, nf4.dequantize(w, torch.float32))  # the caller's buffer holds the weight


def test_dequantize_into_out_returns_out_and_takes_its_dtype():
    w = sample_weight((7, 769), dtype=torch.float32, double_quant=True)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        buffer = torch.full((7, 769), float("nan"), dtype=dtype)
        assert nf4.dequantize(w, out=buffer) is buffer
        assert torch.equal(buffer, nf4.dequantize(w, dtype))
        assert w.dequantize(dtype, out=buffer) is buffer


def test_dequantize_into_out_on_the_reference_backend():
    w = sample_weight((3, 769), double_quant=True)
    buffer = torch.zeros(3, 769, dtype=torch.bfloat16)
    with pykernels.backend.forced("nf4", "torch"):
        assert nf4.dequantize(w, out=buffer) is buffer
    assert torch.equal(buffer, nf4.dequantize(w))


def test_compile_dequantize_with_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(lambda w: nf4.dequantize(w) * 2, fullgraph=True, dynamic=True)
    for rows in (3, 5, 9):
        w = sample_weight((rows, 256))
        assert torch.equal(compiled(w), nf4.dequantize(w) * 2)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.bool])
def test_quantize_rejects_dtype(dtype):
    with pytest.raises(ValueError, match=r"x must be float32, float16 or bfloat16"):
        nf4.quantize(torch.ones(64, dtype=dtype))


@pytest.mark.parametrize("blocksize", [0, 16, 48, 100, 8192, -64])
def test_quantize_rejects_blocksize(blocksize):
    with pytest.raises(ValueError, match=rf"blocksize must be a power of two in \[32, 4096\], got {blocksize}"):
        nf4.quantize(torch.randn(256), blocksize=blocksize)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_quantize_rejects_empty(shape):
    with pytest.raises(ValueError, match="x must not be empty"):
        nf4.quantize(torch.empty(shape))


def test_quantize_rejects_non_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        nf4.quantize([1.0, 2.0])


def test_raw_op_rejects_non_contiguous_input():
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.nf4_quantize(torch.randn(64, 64).t(), 64)


def test_dequantize_op_rejects_non_contiguous_packed():
    w = sample_weight((4, 256))
    packed = torch.stack([w.packed, w.packed], dim=1)[:, 0]
    assert not packed.is_contiguous()
    with pytest.raises(ValueError, match="packed must be contiguous"):
        ops.nf4_dequantize(packed, w.absmax, 64, [4, 256], torch.float32)


def test_dequantize_op_names_wrong_absmax():
    w = sample_weight((4, 256))
    with pytest.raises(ValueError, match=r"absmax must have 16 elements, got 15"):
        ops.nf4_dequantize(w.packed, w.absmax[:15].contiguous(), 64, [4, 256], torch.float32)
    with pytest.raises(ValueError, match=r"absmax must be Float, got Half"):
        ops.nf4_dequantize(w.packed, w.absmax.half(), 64, [4, 256], torch.float32)
    with pytest.raises(ValueError, match=r"packed must have 1024 elements, got 512"):
        ops.nf4_dequantize(w.packed, w.absmax, 64, [4, 256, 2], torch.float32)


def test_dequantize_op_requires_all_nested_tensors():
    w = sample_weight((4, 256), double_quant=True)
    with pytest.raises(ValueError, match="must be given together"):
        ops.nf4_dequantize(w.packed, w.absmax_q, 64, [4, 256], torch.float32, w.nested_absmax)


def test_dequantize_rejects_dtype():
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        nf4.dequantize(sample_weight(), torch.int8)


@pytest.mark.parametrize(("out", "dtype", "error", "match"), [
    ([0.0] * 4, None, TypeError, "out must be a torch.Tensor, got list"),
    (torch.empty(4, 255), None, ValueError, r"out must have the weight's shape \(4, 256\), got \(4, 255\)"),
    (torch.empty(1024), None, ValueError, r"out must have the weight's shape \(4, 256\), got \(1024,\)"),
    (torch.empty(4, 256), torch.float16, ValueError, "out is torch.float32 but dtype torch.float16 was asked for"),
    (torch.empty(256, 4).t(), None, ValueError, "out must be contiguous"),
    (torch.empty(4, 256, requires_grad=True), None, ValueError, "out must not require grad"),
    (torch.empty(4, 256, dtype=torch.int32), None, ValueError,
     "out must be float32, float16 or bfloat16, got torch.int32"),
])
def test_dequantize_rejects_bad_out(out, dtype, error, match):
    with pytest.raises(error, match=match):
        nf4.dequantize(sample_weight((4, 256)), dtype, out=out)


def test_dequantize_into_op_names_a_bad_out():
    w = sample_weight((4, 256))
    with pytest.raises(ValueError, match="out must be contiguous"):
        ops.nf4_dequantize_into(w.packed, w.absmax, 64, torch.empty(256, 4).t())
    with pytest.raises(ValueError, match="out must be float32, float16 or bfloat16"):
        ops.nf4_dequantize_into(w.packed, w.absmax, 64, torch.empty(4, 256, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"packed must have 256 elements, got 512"):
        ops.nf4_dequantize_into(w.packed, w.absmax, 64, torch.empty(2, 256))


def test_dequantize_rejects_non_weight():
    with pytest.raises(TypeError, match="weight must be an NF4Weight, got Tensor"):
        nf4.dequantize(torch.zeros(4))


def test_nf4weight_validates_fields():
    w = sample_weight((4, 256))
    with pytest.raises(ValueError, match=r"NF4Weight.packed must have 512 elements, got 511"):
        NF4Weight(packed=w.packed[:511], absmax=w.absmax, shape=w.shape, dtype=w.dtype, blocksize=64)
    with pytest.raises(ValueError, match=r"NF4Weight.absmax must be torch.float32, got torch.float16"):
        NF4Weight(packed=w.packed, absmax=w.absmax.half(), shape=w.shape, dtype=w.dtype, blocksize=64)
    with pytest.raises(ValueError, match=r"NF4Weight.blocksize must be one of"):
        NF4Weight(packed=w.packed, absmax=w.absmax, shape=w.shape, dtype=w.dtype, blocksize=48)
    with pytest.raises(ValueError, match=r"absmax_q needs nested_absmax, nested_offset, nested_code"):
        NF4Weight(packed=w.packed, absmax_q=w.absmax.to(torch.uint8), shape=w.shape, dtype=w.dtype, blocksize=64)


def test_meta_tensor_is_rejected_with_device_name():
    with pytest.raises(RuntimeError, match="x is on meta; pykernels has kernels for cpu and cuda only"):
        nf4.quantize(torch.empty(64, device="meta"))


def test_cuda_tensor_on_cpu_only_build_is_rejected(monkeypatch):
    monkeypatch.setattr(_extension, "HAS_CUDA", False)
    fake_cuda_tensor = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match=r"x is on cuda:0, but this pykernels build has no CUDA kernels"):
        _extension.check_device(fake_cuda_tensor, "x")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_is_accepted_or_rejected_clearly():
    x = torch.randn(256, device="cuda")
    if _extension.HAS_CUDA:
        assert nf4.quantize(x).packed.is_cuda
    else:
        with pytest.raises(RuntimeError, match="no CUDA kernels"):
            nf4.quantize(x)


@pytest.mark.parametrize("double_quant", [False, True])
def test_reference_switch_gives_the_same_bits(double_quant):
    from pykernels.backend import kernels_mode

    x = torch.randn(7, 769, dtype=torch.bfloat16)
    compiled = nf4.quantize(x, 64, double_quant)
    with kernels_mode("reference"):
        reference_weight = nf4.quantize(x, 64, double_quant)
        reference_dense = nf4.dequantize(compiled, torch.float32)
    for name, tensor in compiled.tensors().items():
        assert torch.equal(getattr(reference_weight, name), tensor), name
    assert torch.equal(reference_dense, nf4.dequantize(compiled, torch.float32))


def test_kernel_switch_rejects_unknown_modes():
    from pykernels.backend import set_kernels

    with pytest.raises(ValueError, match="kernels must be one of"):
        set_kernels("fast")
