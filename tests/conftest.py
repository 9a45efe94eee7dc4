import pytest
import torch

CUDA = torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (run on the GPU machine, see README)"
)


def cpu_isas() -> list[str]:
    """Every CPU SIMD path this machine can run: tests cover each, not just the default."""
    import pykernels

    return ["scalar", "avx512"] if pykernels.build_info()["cpu_isa_detected"] == "avx512" else ["scalar"]


@pytest.fixture(params=cpu_isas())
def cpu_isa(request):
    from pykernels import _C

    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa("auto")
