"""One NeMo Gym agent episode (the answer of POST /run) as one training sequence.

NeMo Gym's vllm_model server, with return_token_id_information, puts on the last output item of every model
call (a message or a function_call) the call's `prompt_token_ids` (the whole conversation so far, rendered by
the vLLM server's chat template), `generation_token_ids` and `generation_log_probs`. The sequence is the
first call's prompt (the group's prompt) and generation, then per later call the environment's tokens (the
part of its prompt beyond everything before it: tool results, the next generation prompt) and its
generation. Only generation tokens carry loss and importance weight; their sampling logprobs are the
server's.

A later call's prompt must extend the sequence token for token. A chat template that re-renders earlier
turns (e.g. a tool call's JSON re-serialized, thinking dropped) breaks that: the episode then ends at the
last consistent turn, cut (finish "length", so algo.mask_truncated_completions applies; not `done`), and
counts in `episodes/prefix_mismatch_fraction`. So does an episode whose tokens pass max_tokens. Its reward
stays /run's: the outcome of what the model did, of which the later turns are not trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from driver.data.records import Episode, Sample, Span

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass
class RunEpisode:
    prompt_ids: list[int] | None  # the first model call's prompt (None: no call returned tokens)
    sample: Sample


@dataclass(frozen=True)
class ModelCall:
    prompt_ids: list[int]
    generation_ids: list[int]
    logprobs: list[float]
    items: list[dict]  # the output items up to and including the one carrying the tokens


def episode_from_run(answer: dict, version: int, max_tokens: int) -> RunEpisode:
    """The /run answer (the verify response: `response` with its output items, `reward`) as one sample sampled by
    adapter `version`, its completion capped at max_tokens tokens (the environment's included)."""
    response = answer.get("response") or {}
    calls, tail = model_calls(response.get("output") or [])
    episode = Episode(reward=float(answer["reward"]), done=True)
    sample = Sample([], [], "stop", [Span(0, 0, version)], episode=episode)  # a version even with no tokens
    if not calls:
        sample.finish_reason = "length"  # no model call returned tokens (e.g. the prompt overflowed the context)
        episode.done = False
        return RunEpisode(None, sample)
    prompt_ids = calls[0].prompt_ids
    for index, call in enumerate(calls):
        sequence_length = len(prompt_ids) + len(sample.token_ids)
        environment = call.prompt_ids[sequence_length:]
        if index and call.prompt_ids[:sequence_length] != prompt_ids + sample.token_ids:
            episode.prefix_mismatch = True
            return _cut(RunEpisode(prompt_ids, sample))
        if len(sample.token_ids) + len(environment) + len(call.generation_ids) > max_tokens:
            return _cut(RunEpisode(prompt_ids, sample))
        if environment:
            start = len(sample.token_ids)
            episode.environment_spans.append((start, start + len(environment)))
            sample.token_ids += environment
            sample.logprobs += [0.0] * len(environment)
        sample.token_ids += call.generation_ids
        sample.logprobs += call.logprobs
        _add_items(episode, call.items)
        episode.turns += 1
    sample.spans = [Span(0, len(sample.token_ids), version)]  # one /run, one version (environment tokens inside)
    _add_items(episode, tail)
    if (response.get("incomplete_details") or {}).get("reason") == "max_output_tokens":
        sample.finish_reason = "length"  # the last model call hit max_output_tokens
        episode.done = False
    return RunEpisode(prompt_ids, sample)


def _cut(run: RunEpisode) -> RunEpisode:
    run.sample.finish_reason = "length"
    run.sample.episode.done = False
    return run


def model_calls(output: list[dict]) -> tuple[list[ModelCall], list[dict]]:
    """(the model calls in order, each with its output items; the items after the last call)."""
    calls, items = [], []
    for item in output:
        items.append(item)
        if not any(item.get(name) is not None for name in TOKEN_FIELDS):
            continue
        missing = [name for name in TOKEN_FIELDS if item.get(name) is None]
        if missing:
            raise ValueError(f"a /run output item ({item.get('type')}) carries some token fields but not {missing}")
        generation, logprobs = [int(token) for token in item["generation_token_ids"]], item["generation_log_probs"]
        if len(generation) != len(logprobs):
            raise ValueError(f"a /run output item has {len(generation)} generation_token_ids and {len(logprobs)} "
                             "generation_log_probs")
        calls.append(ModelCall([int(token) for token in item["prompt_token_ids"]], generation,
                               [float(logprob) for logprob in logprobs], items))
        items = []
    return calls, items


def _add_items(episode: Episode, items: list[dict]) -> None:
    """Output items as TRL's conversational messages: assistant turns (text, tool_calls), tool results."""
    for item in items:
        kind = item.get("type")
        if kind == "message" and item.get("role") == "assistant":
            text = "".join(part.get("text", "") for part in item.get("content") or [] if isinstance(part, dict))
            episode.messages.append({"role": "assistant", "content": text})
        elif kind == "function_call":
            if not episode.messages or episode.messages[-1]["role"] != "assistant":
                episode.messages.append({"role": "assistant", "content": ""})
            turn = episode.messages[-1]
            turn.setdefault("tool_calls", []).append({"type": "function", "id": item.get("call_id"), "function": {
                "name": item.get("name"), "arguments": _arguments(item.get("arguments"))}})
            episode.tool_calls += 1
        elif kind == "function_call_output":
            output = item.get("output")
            episode.messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": str(output)})
            episode.tool_failures += tool_failed(output)


def _arguments(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text  # malformed: kept as the model wrote it


def tool_failed(output) -> bool:
    """A tool result that reports an error: simple_agent's {"error": ...} for arguments that are not JSON, or a
    resources server's HTTP error body (FastAPI's {"detail": ...}: no such tool, arguments that fail validation)."""
    try:
        value = json.loads(output) if isinstance(output, str) else output
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and ("error" in value or set(value) == {"detail"})
