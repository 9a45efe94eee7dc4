"""What every generation backend returns and must be able to do."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the engine's sampling logprobs (after temperature), one per token
    finish_reason: str  # "stop" (end of sequence) or "length" (hit max_tokens)


@dataclass(frozen=True)
class Request:
    """n samples continuing token_ids (a prompt, or a prompt + the completion so far)."""

    token_ids: list[int]
    n: int
    seed: int  # vLLM seeds sample j with seed + j
    max_tokens: int
    temperature: float | None = None  # None: rollout.sampling.temperature; an evaluation's own (0: greedy, n = 1)


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """vLLM seeds sample j of a request with seed + j, so prompts get seeds n apart: with seed +
    prompt_index, sample j of prompt i and sample j - 1 of prompt i + 1 would draw the same numbers."""
    return seed + prompt_index * n


def generate_by_stream(generator: Generator, prompts: list[list[int]], n: int, seed: int,
                       max_tokens: int) -> list[list[Completion]]:
    """Generator.generate for a backend that streams: every prompt with the served adapter, in order."""
    requests = [Request(p, n, request_seed(seed, i, n), max_tokens) for i, p in enumerate(prompts)]
    results = dict(generator.stream(requests, generator.adapter_version))
    return [results[index] for index in range(len(requests))]


class RolloutError(RuntimeError):
    """Generation failed in a way the user can act on (reported without a traceback)."""


class SyncError(RolloutError):
    """The inference engine does not serve the weights the trainer just saved."""


class Generator(Protocol):
    adapter_version: int  # version of the adapter the engine currently serves (0: none yet)
    keep_versions: int  # adapter versions kept servable (the newest ones)

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        """n completions per prompt (token ids), with the adapter of the last sync."""

    def stream(self, requests: list[Request], version: int) -> Iterator[tuple[int, list[Completion]]]:
        """(request index, its n completions) as each request finishes, sampled by adapter `version`
        (one synced earlier and still kept: see `keep_versions`)."""

    def sync(self, adapter_dir: Path, version: int) -> None:
        """Serve the PEFT adapter saved in adapter_dir as `version` from now on; earlier versions stay
        servable until `keep_versions` newer ones exist (requests of prefetched jobs still name them)."""

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """logprob of token_ids[i] given token_ids[:i] for i >= 1 (temperature 1), current adapter."""

    def close(self) -> None:
        ...
