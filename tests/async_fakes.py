"""Stand-ins for vLLM, the policy and the tokenizer, for deterministic tests of the rollout pipeline.

FakeGenerator encodes everything in token ids: prompt tokens are < 1000; a completion starts with
1000 + L, where L (its natural length) comes from the request's seed, then counts up from 2000, so
a continuation request (prompt + completion so far) knows where it is. Every sampled token's
logprob is -0.1 * (version + 1): a test can tell which version sampled which span.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from driver.data.prompts import PromptSource
from driver.engine.base import Completion, Request
from driver.rollouts.feed import Rollouts

COMPLETION_BASE = 1000


def natural_length(seed: int, sample: int, lengths: tuple[int, ...]) -> int:
    return lengths[(seed + sample) % len(lengths)]


class FakeGenerator:
    def __init__(self, lengths: tuple[int, ...] = (3, 5, 2, 4), delay: float = 0.0,
                 serves_one_version: bool = False) -> None:
        self.lengths, self.delay = lengths, delay
        self.adapter_version, self.keep_versions = 0, 1 if serves_one_version else 2
        self.serves_one_version = serves_one_version
        self.versions: dict[int, str] = {}
        self.calls: list[tuple[str, int, float, float]] = []  # (kind, version, start, end)
        self.requests: list[tuple[int, Request]] = []  # (version, request)
        self.active = 0
        self.overlaps = 0  # engine calls that ran while another one was running
        self._lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def _enter(self) -> float:
        with self._lock:
            self.active += 1
            self.overlaps += self.active > 1
        return time.perf_counter()

    def _leave(self, kind: str, version: int, start: float) -> None:
        with self._lock:
            self.active -= 1
            self.calls.append((kind, version, start, time.perf_counter()))

    def stream(self, requests: list[Request], version: int):
        start = self._enter()
        try:
            self.gate.wait()
            if self.serves_one_version and version != self.adapter_version:
                raise AssertionError(f"job of version {version} while the engine serves {self.adapter_version}")
            if not self.serves_one_version and self.versions and version not in self.versions:
                raise AssertionError(f"version {version} is not kept ({sorted(self.versions)})")
            if self.delay:
                time.sleep(self.delay)
            results = [(index, self._complete(request, version)) for index, request in enumerate(requests)]
            self.requests += [(version, request) for request in requests]
        finally:
            self._leave("stream", version, start)
        yield from reversed(results)  # finish out of order: consumers must not rely on it

    def _complete(self, request: Request, version: int) -> list[Completion]:
        done = [t for t in request.token_ids if t >= COMPLETION_BASE]
        out = []
        for sample in range(request.n):
            length = int(done[0]) - COMPLETION_BASE if done else natural_length(request.seed, sample, self.lengths)
            tokens = [] if done else [COMPLETION_BASE + length]
            position = len(done) + len(tokens)
            while position < length and len(tokens) < request.max_tokens:
                tokens.append(2000 + position)
                position += 1
            tokens = tokens[: request.max_tokens]
            reason = "stop" if len(done) + len(tokens) >= length else "length"
            out.append(Completion(tokens, [-0.1 * (version + 1)] * len(tokens), reason))
        return out

    def generate(self, prompts, n, seed):
        raise AssertionError("the pipeline streams")

    def sync(self, adapter_dir: Path, version: int) -> None:
        start = self._enter()
        self.versions[version] = str(adapter_dir)
        for old in sorted(self.versions)[: -self.keep_versions]:
            del self.versions[old]
        self.adapter_version = version
        self._leave("sync", version, start)

    def prompt_logprobs(self, token_ids):
        raise AssertionError("tests run without the sync probe")

    def close(self) -> None:
        pass


class FakeTokenizer:
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = False):
        class Encoded:
            input_ids = [1 + ord(c) % 900 for c in text]
        return Encoded()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


class FakePolicy:
    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.saved: list[int] = []

    def save_trained(self, directory: Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return directory


def length_parity(completions, prompts, **columns):
    """1 for an even natural length, 0 for odd; every sample of a prompt containing 'flat' gets 0."""
    return [0.0 if "flat" in prompt else float((int(text.split()[0]) - COMPLETION_BASE) % 2 == 0)
            for prompt, text in zip(prompts, completions)]


def make_rollouts(config, generator: FakeGenerator | None = None, start_step: int = 0, state=None) -> Rollouts:
    """Rollouts over the fakes: the config's prompts, FakePolicy's tokenizer, no sync verifier."""
    policy = FakePolicy()
    prompts = PromptSource(config.data, policy.tokenizer, config.train.seed)
    return Rollouts(config, policy, generator or FakeGenerator(), prompts, None, start_step, state)


def run_steps(rollouts: Rollouts, steps: int, start: int = 0) -> list:
    """The training loop's calls, without the update: next_batch, then push."""
    batches = []
    for step in range(start, start + steps):
        batches.append(rollouts.next_batch(step))
        rollouts.push(step + 1)
    return batches
