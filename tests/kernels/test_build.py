"""The compiled extension describes itself and registers every op of the families it reports."""

import pytest
import torch

import pykernels
from benchmarks.conftest import cpu_flags
from pykernels import _C

OPS_BY_FAMILY = {
    "nf4": ["nf4_quantize", "nf4_dequantize", "nf4_dequantize_into", "dynamic8_quantize", "dynamic8_dequantize"],
    "lora": ["lora_linear", "lora_linear_nf4", "lora_linear_backward", "lora_linear_nf4_backward"],
    "logprobs": ["token_logprobs", "token_logprobs_backward"],
    "moe": ["moe_sort_tokens", "moe_grouped_linear", "moe_grouped_linear_backward"],
}


def test_build_info_fields():
    info = pykernels.build_info()
    assert set(info) >= {"families", "cuda", "cuda_archs", "cutlass_version", "torch_version", "cpu_isa"}
    assert "nf4" in info["families"]
    assert info["cuda"] == _C.has_cuda()
    assert info["cuda_archs"] == (_C.cuda_archs() if info["cuda"] else [])
    # the Hopper GEMM core is in exactly when sm_90a is among the archs (cmake/sm90_sources.cmake)
    assert info["hopper_gemm"] == ("90a" in info["cuda_archs"])
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0], (
        "rebuild: _C was built for another torch"
    )


def test_cutlass_version_is_reported():
    version = pykernels.build_info()["cutlass_version"]
    assert version is None or version.count(".") == 2


@pytest.mark.parametrize("family", sorted(OPS_BY_FAMILY))
def test_family_ops_are_registered(family):
    if family not in pykernels.build_info()["families"]:
        pytest.fail(f"family {family} has tests but is not in the build")
    for name in OPS_BY_FAMILY[family]:
        assert hasattr(torch.ops.pykernels, name), name


def test_cpu_isa_switch_rejects_unknown_names():
    with pytest.raises(ValueError, match="cpu isa must be 'auto', 'scalar', 'avx2', 'avx512' or 'amx', got 'sse9'"):
        _C.set_cpu_isa("sse9")
    _C.set_cpu_isa("scalar")
    assert pykernels.build_info()["cpu_isa"] == "scalar"
    _C.set_cpu_isa("auto")
    assert pykernels.build_info()["cpu_isa"] == pykernels.build_info()["cpu_isa_detected"]


def test_cpu_isa_switch_refuses_a_path_this_cpu_cannot_run():
    detected = pykernels.build_info()["cpu_isa_detected"]
    runs = {"scalar": (), "avx2": ("avx2",), "avx512": ("avx2", "avx512"), "amx": ("avx2", "avx512", "amx")}[detected]
    for name, lacks in (("avx2", "AVX2"), ("avx512", "AVX-512"), ("amx", "AMX")):
        if name in runs:
            continue
        with pytest.raises(ValueError, match=f"cpu isa '{name}' requested but this CPU lacks {lacks}"):
            _C.set_cpu_isa(name)
        assert pykernels.build_info()["cpu_isa"] == detected


@pytest.mark.skipif(not cpu_flags() >= {"avx2", "fma", "f16c"}, reason="this CPU has no AVX2 / FMA / F16C")
def test_a_cpu_with_avx2_runs_a_vector_path():
    assert pykernels.build_info()["cpu_isa_detected"] in ("avx2", "avx512", "amx")


@pytest.mark.skipif(not cpu_flags() >= {"amx_tile", "amx_bf16", "avx512_bf16"}, reason="this CPU has no AMX")
def test_a_cpu_with_amx_runs_the_amx_path():
    """Linux lists amx_* only when it supports the tile state, so the extension's own check (CPUID and
    the arch_prctl request, csrc/common/cpu_gemm_amx.cpp) must find it usable too."""
    assert pykernels.build_info()["cpu_isa_detected"] == "amx"
