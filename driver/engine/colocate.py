"""vLLM in the training process: the engine loads the base model once; every sync saves the
adapter to a new versioned directory and generation uses a new LoRARequest for it."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

from driver.cli import ConfigError
from driver.config import Config, SamplingConfig
from driver.engine.base import Completion, Request, RolloutError, SyncError, generate_by_stream
from driver.engine.options import check_engine_options

# vLLM accepts only these LoRA ranks as the engine's maximum.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(r: int) -> int:
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise SyncError(f"lora.r = {r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


LORA_ENGINE_KEYS = ("enable_lora", "max_lora_rank", "max_loras")


def engine_kwargs(config: Config, model_dir: str, lora: bool | None = None) -> dict:
    """Arguments shared by the colocated engine and a launched server; a ConfigError naming the key when this
    machine or the installed vLLM cannot run them (driver/engine/options.py). lora: with the LoRA ones, which a
    server reloading merged weights must not have (with LoRA slots vLLM on CPU takes a Triton-only path for
    experts); None: unless under full fine-tuning or with rollout.weight_sync = merged given (the caller knows
    what auto resolves to: driver.engine.weight_sync_mode)."""
    rollout = config.rollout
    if lora is None:
        lora = config.model.adapter != "none" and rollout.weight_sync != "merged"
    check_engine_options(config, cuda_available())
    kwargs = dict(
        model=model_dir, dtype=rollout.dtype or config.model.dtype,
        seed=config.train.seed if rollout.seed is None else rollout.seed,
        max_model_len=rollout.max_model_len, gpu_memory_utilization=rollout.gpu_memory_utilization,
        tensor_parallel_size=rollout.tensor_parallel_size, data_parallel_size=rollout.data_parallel_size,
        quantization=rollout.quantization, enforce_eager=rollout.enforce_eager,
        enable_prefix_caching=rollout.enable_prefix_caching, max_num_seqs=rollout.max_num_seqs,
        enable_sleep_mode=rollout.enable_sleep_mode,
        # Engine calls are serialized and each names one version, so one engine batch holds one
        # adapter; the second slot keeps the previous version loaded for the job prefetched with it.
        enable_lora=True, max_lora_rank=engine_lora_rank(config.lora.r), max_loras=2,
        # Logprobs of the distribution actually sampled from (after temperature / top-k / top-p):
        # what importance sampling must compare the trainer's logprobs with.
        logprobs_mode="processed_logprobs",
        # vLLM on CPU dies on a seeded request whose prefill is split across steps (it rewinds the request's
        # generator by an offset, which CPU generators lack: "CPU Generator does not use offset"). Every
        # request is seeded (reproducible runs), and chat prompts x num_generations overflow the CPU token
        # budget, so prefills are never split there.
        enable_chunked_prefill=False if not cuda_available() else None,
    )
    if not lora:  # every sync replaces the weights: no LoRA slots
        kwargs = {key: value for key, value in kwargs.items() if key not in LORA_ENGINE_KEYS}
    return kwargs


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def set_cpu_defaults() -> None:
    """KV cache size on CPU (GiB): vLLM's default takes a large share of memory. vLLM's INFO logs
    would bury the progress bar; VLLM_LOGGING_LEVEL=INFO brings them back."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def sampling_params(sampling: SamplingConfig, n: int, seed: int, max_tokens: int | None = None,
                    temperature: float | None = None):
    """vLLM's SamplingParams of one request (temperature: the section's unless given); a ConfigError naming the
    key when vLLM refuses the section's values (generation_kwargs are passed through unchecked until here)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    options = sampling.engine_sampling(temperature)
    try:
        structured = (StructuredOutputsParams(**sampling.structured_outputs)
                      if sampling.structured_outputs is not None else None)
        # Stop strings are matched on text: only then does the engine need to detokenize (the driver
        # decodes what it needs itself).
        return SamplingParams(n=n, max_tokens=max_tokens or sampling.max_tokens, logprobs=0, seed=seed,
                              detokenize=bool(options.get("stop")), structured_outputs=structured, **options)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"rollout.sampling (generation_kwargs {sampling.generation_kwargs}, structured_outputs "
                          f"{sampling.structured_outputs}): vLLM refused them: {error}") from error


class ColocatedGenerator:
    # rollout.enable_sleep_mode: the engine sleeps between generations (a subclass with an engine of its
    # own, whose weights are written in place, never does).
    _sleeps = False
    _asleep = False

    def __init__(self, config: Config, model_dir: str) -> None:
        set_cpu_defaults()  # before vllm is imported: it reads these at import
        from vllm import LLM

        self.config = config
        self._sleeps = config.rollout.enable_sleep_mode
        self.adapter_version = 0
        self.keep_versions = 2
        self._lora = None
        self._loras: dict[int, object] = {}  # version -> LoRARequest, the newest keep_versions
        sampling_params(config.rollout.sampling, 1, 0)  # a bad generation_kwargs fails before the engine starts
        self.llm = LLM(**engine_kwargs(config, model_dir))

    def _sampling_params(self, request: Request):
        return sampling_params(self.config.rollout.sampling, request.n, request.seed, request.max_tokens,
                               request.temperature)

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        return generate_by_stream(self, prompts, n, seed, self.config.rollout.sampling.max_tokens)

    def stream(self, requests: list[Request], version: int) -> Iterator[tuple[int, list[Completion]]]:
        """Requests finish in any order; each is yielded as soon as all its n samples are done, so
        their rewards can be computed while the engine (its own process) generates the rest."""
        from vllm.inputs import TokensPrompt

        lora = self._lora_of(version)
        params = [self._sampling_params(r) for r in requests]
        self._wake_up()
        try:
            ids = self.llm.enqueue([TokensPrompt(prompt_token_ids=r.token_ids) for r in requests], params,
                                   lora_request=lora, use_tqdm=False)
            # Outputs carry the id given to the engine, before it appends a random suffix.
            index_of = {request_id.split("-", 1)[0]: index for index, request_id in enumerate(ids)}
            engine = self.llm.llm_engine
            while index_of and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in index_of:
                        yield index_of.pop(output.request_id), [_completion(s) for s in output.outputs]
            if index_of:
                raise RolloutError(f"vLLM finished without answering {len(index_of)} of {len(requests)} requests")
        finally:
            self._sleep()

    def _sleep(self) -> None:
        """rollout.enable_sleep_mode, after a generation: level 1 moves the weights to CPU memory and frees
        the KV cache (its contents forgotten) for the trainer's update. The engine is idle: every call
        into it holds the rollouts' engine_lock, the trainer's thread makes them all (sleep mode is
        refused with async_prefetch, whose thread generates while the trainer trains), and a generation
        left unfinished (its consumer failed) is aborted."""
        if self._sleeps and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake_up(self) -> None:
        """Before the engine computes anything: weights back on the GPU, the KV cache allocated again.
        A sync needs no wake-up (an adapter is loaded by the first request naming it); the probe after
        it leaves the engine awake for the generation that follows."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _lora_of(self, version: int):
        if not self._loras and version == 0:
            return None  # nothing synced yet: the base model
        if version not in self._loras:
            raise RolloutError(f"adapter version {version} is not servable (kept: {sorted(self._loras)})")
        return self._loras[version]

    def sync(self, adapter_dir: Path, version: int) -> None:
        from vllm.lora.request import LoRARequest

        # A new name and id per version: vLLM caches adapters by id, so reusing one would keep
        # serving the old weights (the field's most common silent failure).
        self._lora = LoRARequest(f"adapter-v{version}", version + 1, str(adapter_dir))
        self._loras[version] = self._lora
        for old in sorted(self._loras)[:-self.keep_versions]:
            del self._loras[old]
        self.adapter_version = version

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        self._wake_up()
        output = self.llm.generate([TokensPrompt(prompt_token_ids=token_ids)], params, lora_request=self._lora,
                                   use_tqdm=False)[0]
        return [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:])]

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        try:
            if engine is not None and hasattr(engine, "engine_core"):
                engine.engine_core.shutdown()
        except Exception:  # the engine may already be gone (e.g. it received the Ctrl-C too)
            pass
        del llm
        gc.collect()


def _completion(sample) -> Completion:
    token_ids = list(sample.token_ids)
    logprobs = [entry[token].logprob for entry, token in zip(sample.logprobs, token_ids)]
    return Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=sample.finish_reason or "length")
