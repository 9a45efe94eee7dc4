"""vLLM in the training process: the engine loads the base model once; every sync saves the
adapter to a new versioned directory and generation uses a new LoRARequest for it."""

from __future__ import annotations

import gc
import os
from pathlib import Path

from driver.config import Config
from driver.rollout.base import Completion, SyncError, request_seed

# vLLM accepts only these LoRA ranks as the engine's maximum.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def engine_lora_rank(r: int) -> int:
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise SyncError(f"lora.r = {r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def engine_kwargs(config: Config, model_dir: str) -> dict:
    """Arguments shared by the colocated engine and a launched server."""
    return dict(
        model=model_dir, dtype=config.model.dtype, seed=config.train.seed,
        max_model_len=config.rollout.max_model_len,
        gpu_memory_utilization=config.rollout.gpu_memory_utilization,
        enable_lora=True, max_lora_rank=engine_lora_rank(config.lora.r), max_loras=2,
        # Logprobs of the distribution actually sampled from (after temperature / top-k / top-p):
        # what importance sampling must compare the trainer's logprobs with.
        logprobs_mode="processed_logprobs",
    )


def set_cpu_defaults() -> None:
    """KV cache size on CPU (GiB): vLLM's default takes a large share of memory. vLLM's INFO logs
    would bury the progress bar; VLLM_LOGGING_LEVEL=INFO brings them back."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class ColocatedGenerator:
    def __init__(self, config: Config, model_dir: str) -> None:
        set_cpu_defaults()  # before vllm is imported: it reads these at import
        from vllm import LLM

        self.config = config
        self.adapter_version = 0
        self._lora = None
        self.llm = LLM(**engine_kwargs(config, model_dir))

    def _sampling_params(self, n: int, seed: int):
        from vllm import SamplingParams

        sampling = self.config.rollout.sampling
        return SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                              max_tokens=sampling.max_tokens, logprobs=0, seed=seed)

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        params = [self._sampling_params(n, request_seed(seed, i, n)) for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    lora_request=self._lora, use_tqdm=False)
        return [[_completion(sample) for sample in output.outputs] for output in outputs]

    def sync(self, adapter_dir: Path, version: int) -> None:
        from vllm.lora.request import LoRARequest

        # A new name and id per version: vLLM caches adapters by id, so reusing one would keep
        # serving the old weights (the field's most common silent failure).
        self._lora = LoRARequest(f"adapter-v{version}", version + 1, str(adapter_dir))
        self.adapter_version = version

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
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
