"""rollout.backend: transformers: sampling with transformers' `generate` on the trainer's own model, in
the trainer's process (TRL's use_vllm=False), for machines where vLLM does not run and for models so
small that an engine costs more than it saves. One process (no torchrun), no async prefetch (the
sampler would read weights the optimizer is writing), a sync every step.

The trainer and the sampler share the weights, so a sync is free (nothing is saved or loaded) and
there is nothing to verify. The sampling logprobs are those of the distribution each token was drawn
from: log_softmax of the scores after repetition penalty, temperature, top-k, top-p and min-p (our own
processor list, SampledLogprobs last), the quantity vLLM reports as processed logprobs, so importance
weights stay exact. One
generate call per max_tokens value, every request's n samples in it (left-padded prompts), seeded
with the first request's seed: a run is reproducible, as with vLLM's seeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from driver.config import Config
from driver.engine.base import Completion, Request, generate_by_stream
from driver.policy.model import Policy, evaluating


class RepetitionPenalty:
    """transformers' repetition penalty (a seen token's score divided by the penalty, multiplied when
    negative) over each row's prompt and completion so far, but not its left padding: transformers'
    own counts the pad token as seen, which would penalize the end of sequence of every padded row
    (the tiny models pad with it), a distribution vLLM never samples from."""

    def __init__(self, penalty: float, prompt_starts: torch.Tensor) -> None:
        self.penalty, self.prompt_starts = penalty, prompt_starts  # [rows] first real column of each row

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[1]
        starts = self.prompt_starts.to(input_ids.device)[:, None]
        real = torch.arange(input_ids.shape[1], device=input_ids.device) >= starts
        seen = torch.zeros(scores.shape[0], vocab + 1, dtype=torch.bool, device=scores.device)
        seen.scatter_(1, input_ids.masked_fill(~real, vocab), True)  # padding lands in the extra column
        penalized = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen[:, :vocab], penalized, scores)


class SampledLogprobs:
    """The last logits processor of generate: it sees the final (processed) scores of each step; the
    token drawn from them arrives with the next step's input_ids, and the last step's in `finish`. Keeps
    one step's [rows, V] log-probabilities, not generate's output_scores (rows x steps x V)."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.values.append(self.previous.gather(1, input_ids[:, -1:]))
        self.previous = scores.float().log_softmax(dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, steps] logprob of every sampled token (after a row ended: of its padding, unused)."""
        if self.previous is not None:
            self.values.append(self.previous.gather(1, sequences[:, -1:]))
        return torch.cat(self.values, dim=1) if self.values else torch.zeros(len(sequences), 0)


class TransformersGenerator:
    shares_weights = True  # driver/engine/adapter_sync.py: no adapter to save, load or verify
    serves_one_version = True  # the live weights: always the newest version

    def __init__(self, config: Config, policy: Policy) -> None:
        self.config, self.policy = config, policy
        self.adapter_version, self.keep_versions = 0, 1
        tokenizer = policy.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = policy.causal_lm.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos) if isinstance(eos, list) else {eos}

    def generation_kwargs(self, max_tokens: int, recorder: SampledLogprobs, prompt_starts: torch.Tensor,
                          temperature: float | None = None) -> dict:
        """generate's arguments: our own processor list, the recorder last, and every warper generate would
        add itself switched off, so the recorder sees the distribution actually sampled from. temperature:
        the section's unless given; 0 decodes greedily (as vLLM: the most likely token, the others masked)."""
        from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                  TopPLogitsWarper)

        sampling = self.config.rollout.sampling
        temperature = sampling.temperature if temperature is None else temperature
        processors = LogitsProcessorList()
        if sampling.repetition_penalty != 1:
            processors.append(RepetitionPenalty(sampling.repetition_penalty, prompt_starts))
        if temperature == 0:
            processors.append(TopKLogitsWarper(1))
        elif temperature != 1:
            processors.append(TemperatureLogitsWarper(temperature))
        if sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1:
            processors.append(TopPLogitsWarper(sampling.top_p))
        if sampling.min_p > 0:
            processors.append(MinPLogitsWarper(sampling.min_p))
        processors.append(recorder)
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
                      max_new_tokens=max_tokens, logits_processor=processors, return_dict_in_generate=True,
                      use_cache=True, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.policy.tokenizer)
        return {**kwargs, **sampling.generation_kwargs}

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        return generate_by_stream(self, prompts, n, seed, self.config.rollout.sampling.max_tokens)

    def stream(self, requests: list[Request], version: int) -> Iterator[tuple[int, list[Completion]]]:
        batches: dict[tuple[int, float | None], list[int]] = {}  # one generate call per (max_tokens, temperature)
        for index, request in enumerate(requests):
            batches.setdefault((request.max_tokens, request.temperature), []).append(index)
        for (max_tokens, temperature), indices in batches.items():
            completions = self._sample([requests[i] for i in indices], max_tokens, temperature)
            yield from zip(indices, completions)

    @torch.no_grad()
    def _sample(self, requests: list[Request], max_tokens: int, temperature: float | None) -> list[list[Completion]]:
        rows = [request.token_ids for request in requests for _ in range(request.n)]
        width = max(len(row) for row in rows)
        device = self.policy.device
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
        for row, tokens in enumerate(rows):  # left padding: every row's next token at the same column
            input_ids[row, width - len(tokens):] = torch.tensor(tokens)
            attention_mask[row, width - len(tokens):] = 1
        torch.manual_seed(requests[0].seed)
        recorder = SampledLogprobs()
        with evaluating(self.policy.model):
            output = self.policy.causal_lm.generate(input_ids=input_ids.to(device),
                                                    attention_mask=attention_mask.to(device),
                                                    **self.generation_kwargs(max_tokens, recorder,
                                                                             width - attention_mask.sum(dim=1),
                                                                             temperature))
        tokens = output.sequences[:, width:].cpu()
        logprobs = recorder.finish(output.sequences).cpu()
        completions, row = [], 0
        for request in requests:
            samples = []
            for _ in range(request.n):
                samples.append(self._completion(tokens[row].tolist(), logprobs[row].tolist(), max_tokens))
                row += 1
            completions.append(samples)
        return completions

    def _completion(self, tokens: list[int], logprobs: list[float], max_tokens: int) -> Completion:
        """The row's tokens up to and including the one that ended it (an end of sequence, vLLM's
        convention, or the token completing a stop string), or all of them. generate pads a finished row,
        and the pad may be the end-of-sequence token: a stop string before the first one is what ended it."""
        eos = next((position for position, token in enumerate(tokens) if token in self.eos_ids), None)
        stopped = self._stop_string_end(tokens[:eos] if eos is not None else tokens)
        if stopped is not None:
            return Completion(tokens[:stopped], logprobs[:stopped], "stop")
        if eos is not None:
            return Completion(tokens[: eos + 1], logprobs[: eos + 1], "stop")
        return Completion(tokens, logprobs, "length" if len(tokens) >= max_tokens else "stop")

    def _stop_string_end(self, tokens: list[int]) -> int | None:
        """One past the token that completed a stop string (generate pads after it), or None."""
        stops = self.config.rollout.sampling.stop
        if not stops:
            return None
        tokenizer = self.policy.tokenizer
        for end in range(1, len(tokens) + 1):
            if any(stop in tokenizer.decode(tokens[:end]) for stop in stops):
                return end
        return None

    def sync(self, adapter_dir: Path | None, version: int) -> None:
        self.adapter_version = version  # the weights are the trainer's own: nothing to load

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        raise NotImplementedError("rollout.backend = transformers samples with the trainer's weights: no sync "
                                  "to verify")

    def close(self) -> None:
        pass
