"""CUDA NF4 kernels give the same bits as the CPU kernels (which match bitsandbytes)."""

import random

import pytest
import torch
from test_nf4_bitexact import BLOCKSIZES, DTYPES, SHAPES, assert_bits_equal, special_values

import pykernels.nf4 as nf4
from conftest import requires_cuda
from pykernels._extension import ops
from pykernels.nn import NF4Linear
from pykernels.reference import nf4 as reference

pytestmark = [requires_cuda, pytest.mark.cuda]


def assert_cuda_matches_cpu(x: torch.Tensor, blocksize: int, double_quant: bool) -> None:
    cpu = nf4.quantize(x.cpu(), blocksize)
    gpu = nf4.quantize(x.cuda(), blocksize)
    assert_bits_equal(gpu.packed.cpu(), cpu.packed, "packed")
    assert_bits_equal(gpu.absmax.cpu(), cpu.absmax, "absmax")
    if double_quant:
        # The nested offset is a torch mean, whose reduction order differs between devices, so
        # the 8-bit absmax step is compared on identical inputs.
        cpu = nf4.quantize(x.cpu(), blocksize, double_quant=True)
        fp32_absmax = nf4.quantize(x.cpu(), blocksize).absmax - cpu.nested_offset
        code = cpu.nested_code
        for got, want, name in zip(ops.dynamic8_quantize(fp32_absmax.cuda(), code.cuda(), 256),
                                   ops.dynamic8_quantize(fp32_absmax, code, 256), ("absmax_q", "nested_absmax")):
            assert_bits_equal(got.cpu(), want, name)
    for dtype in DTYPES:
        assert_bits_equal(nf4.dequantize(cpu.to("cuda"), dtype).cpu(), nf4.dequantize(cpu, dtype),
                          f"dequantize {dtype}")


@pytest.fixture(params=["units", "warps"])
def dequantize_kernel(request, monkeypatch):
    """Both dequantize kernels (PYKERNELS_NF4_DEQUANT, csrc/nf4/nf4.h)."""
    monkeypatch.setenv("PYKERNELS_NF4_DEQUANT", request.param)
    return request.param


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_matches_cpu(shape, dtype, blocksize, double_quant):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    assert_cuda_matches_cpu(x, blocksize, double_quant)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("numel", [1024, 2048 + 1000, 64 * 1024 + 5, 1_000_003])
def test_cuda_dequantize_by_warp_chunks(numel, blocksize, double_quant, dequantize_kernel):
    """Whole 1024-value chunks (the warps kernel's 16-byte path), several per warp, and a partial last
    one, at every blocksize (a chunk spans 32 blocks of 32 or sits inside one of 4096): the same bits
    as the CPU dequantize, for every output dtype."""
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(torch.bfloat16)
    weight = nf4.quantize(x, blocksize, double_quant=double_quant)
    on_cuda = weight.to("cuda")
    for dtype in DTYPES:
        assert_bits_equal(nf4.dequantize(on_cuda, dtype).cpu(), nf4.dequantize(weight, dtype), f"{dtype}")


def test_cuda_dequantize_kernel_knob_is_checked(monkeypatch):
    weight = nf4.quantize(torch.randn(4096, device="cuda"), 64)
    monkeypatch.setenv("PYKERNELS_NF4_DEQUANT", "fast")
    with pytest.raises(RuntimeError, match="PYKERNELS_NF4_DEQUANT must be warps"):
        nf4.dequantize(weight)


def test_cuda_random_shapes_match_cpu(dequantize_kernel):
    rng = random.Random(99)
    for _ in range(100):
        shape = tuple(rng.randint(1, 300) for _ in range(rng.randint(1, 3)))
        x = (torch.randn(shape) * 10 ** rng.uniform(-3, 3)).to(rng.choice(DTYPES))
        assert_cuda_matches_cpu(x, rng.choice(BLOCKSIZES), rng.random() < 0.5)


@pytest.mark.parametrize("case", list(special_values(torch.float32)))
def test_cuda_special_values_match_cpu(case, dequantize_kernel):
    for dtype in DTYPES:
        assert_cuda_matches_cpu(special_values(dtype)[case].to(dtype), 64, True)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5])
def test_cuda_unaligned_views(offset, dequantize_kernel):
    """Views that start mid-allocation: the dequantize kernel loads 4 (16-bit out) or 2 (fp32 out)
    packed bytes per thread, so offsets 2 and 4 keep its vector path for some outputs and the
    others take the scalar one; the warps kernel needs 16-byte alignment and leaves such views to the
    units kernel. The same bits every way."""
    base = torch.randn(4096 + 64, dtype=torch.bfloat16)
    x = base[offset : offset + 4096]
    assert_cuda_matches_cpu(x, 64, False)
    w = nf4.quantize(x.cuda(), 64)
    packed = torch.cat([torch.zeros(offset, dtype=torch.uint8, device="cuda"), w.packed])[offset:]
    for dtype in (torch.float32, torch.bfloat16):
        out = ops.nf4_dequantize(packed, w.absmax, 64, [4096], dtype)
        assert torch.equal(out, nf4.dequantize(w, dtype)), dtype


def test_cuda_opcheck():
    x = torch.randn(3, 769, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(ops.nf4_quantize, (x, 64))
    w = nf4.quantize(x, 64, double_quant=True)
    torch.library.opcheck(ops.nf4_dequantize, (w.packed, w.absmax_q, 64, [3, 769], torch.bfloat16,
                                               w.nested_absmax, w.nested_code, w.nested_offset, 256))
    torch.library.opcheck(ops.nf4_dequantize_into, (w.packed, w.absmax_q, 64, torch.empty_like(x), w.nested_absmax,
                                                    w.nested_code, w.nested_offset, 256))
    code = reference.dynamic_map("cuda")
    torch.library.opcheck(ops.dynamic8_quantize, (torch.randn(1000, device="cuda"), code, 256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dequantize_into_out_matches_cpu(dtype, dequantize_kernel):
    x = torch.randn(7, 769, dtype=torch.bfloat16)
    w = nf4.quantize(x, 64, double_quant=True)
    buffer = torch.full((7, 769), float("nan"), dtype=dtype, device="cuda")
    assert nf4.dequantize(w.to("cuda"), out=buffer) is buffer
    assert torch.equal(buffer.cpu(), nf4.dequantize(w, dtype))
    with pytest.raises(ValueError, match="out must be on the weight's device cuda:0, got cpu"):
        nf4.dequantize(w.to("cuda"), out=torch.empty(7, 769))


def test_cuda_compile():
    torch._dynamo.reset()
    fn = torch.compile(lambda x: nf4.dequantize(nf4.quantize(x, 64, True)), fullgraph=True)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fn(x), nf4.dequantize(nf4.quantize(x, 64, True)))


def test_cuda_nf4linear_forward_backward():
    layer = NF4Linear.from_linear(torch.nn.Linear(4096, 1024, dtype=torch.bfloat16).cuda())
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    weight = nf4.dequantize(layer.weight)
    torch.testing.assert_close(y, torch.nn.functional.linear(x.detach(), weight, layer.bias))
    torch.testing.assert_close(x.grad, torch.ones_like(y) @ weight)
