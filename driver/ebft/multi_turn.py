"""EBFT multi-turn rollouts (axolotl's `remaining_turns`): roll out and render a conversation's later turns.

A row whose `remaining_turns` column (driver.ebft.transforms.first_turn) holds later (user, assistant)
turns is trained on its first assistant turn only, but rewarded for the whole conversation it leads to:
once a group's first turns are sampled, the policy answers each later user turn of the data after the
conversation so far (`MultiTurnRollout`, the Producer's extend_finished hook, in the generation thread),
and the features compare that generated conversation with the data's (`feature_sequences`, read by
structured.FeatureScorer in the trainer's thread). Both are rendered with the chat template the same way,
so they compare like with like; the first turn enters as decoded text, as axolotl renders it.

Unlike axolotl's _sequential_rollout: each sample continues its own row's turns (axolotl indexes the
per-sample column by prompt, so with num_generations > 1 most groups get another row's turns); turn k of
every sample finished in a round is one engine batch (axolotl: one call per sample and turn); each turn's
budget is the EBFT budget of the data's answer at that turn (axolotl: max_completion_length); and a failed
engine call fails the run (axolotl continues with an empty turn).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from driver.cli import ConfigError
from driver.config import Config, DataConfig
from driver.data.prompts import Prompt, PromptSource
from driver.data.records import Group, Sample
from driver.ebft.transforms import REMAINING_TURNS_FIELD, check_later_turns
from driver.engine.base import Generator, Request, RolloutError


def remaining_turns(prompt: Prompt) -> list[dict]:
    """The row's later turns, user and assistant alternating ([] for a single-turn row)."""
    return prompt.columns.get(REMAINING_TURNS_FIELD) or []


def is_multi_turn(prompt: Prompt) -> bool:
    return bool(remaining_turns(prompt))


def exchanges(prompt: Prompt) -> list[tuple[dict, dict]]:
    """(user turn, the data's assistant answer) pairs after the first assistant turn."""
    turns = remaining_turns(prompt)
    return list(zip(turns[0::2], turns[1::2]))


def check_multi_turn_rows(config: Config, prompts: PromptSource) -> None:
    """Rows with later turns, checked before the run starts: the turns alternate and end with an answer,
    the prompt is a conversation (or text rendered as one, data.chat_template), and sampling is vLLM's."""
    for prompt in prompts.prompts:
        turns = prompt.columns.get(REMAINING_TURNS_FIELD)
        if not turns:
            continue
        try:
            check_later_turns(turns)
        except ValueError as error:
            raise ConfigError(f"data: row {prompt.index}: {error}") from error
        if prompt.messages is None and not config.data.chat_template:
            raise ConfigError(f"data: row {prompt.index} has later turns ('{REMAINING_TURNS_FIELD}') but its prompt "
                              "is text: multi-turn rollouts render conversations with the chat template; give the "
                              "prompt as chat messages or set data.chat_template: true")
        if config.ebft.mode != "structured":
            raise ConfigError(f"data: row {prompt.index} has later turns ('{REMAINING_TURNS_FIELD}'): multi-turn "
                              "rollouts are ebft.mode structured only; in strided mode use "
                              "driver.ebft.transforms.last_turn or all_turns")


def prompt_messages(prompt: Prompt) -> list[dict]:
    """The prompt as chat messages: its conversation, or its text as one user turn (data.chat_template)."""
    return list(prompt.messages) if prompt.messages is not None else [{"role": "user", "content": prompt.text}]


def generated_conversation(prompt: Prompt, first_turn: str, later_turns: tuple[str, ...] | list[str]) -> list[dict]:
    """Prompt, the sampled first turn, then each data user turn with the policy's answer, as far as generated."""
    messages = prompt_messages(prompt) + [{"role": "assistant", "content": first_turn}]
    for (user, _), answer in zip(exchanges(prompt), later_turns, strict=False):
        messages += [user, {"role": "assistant", "content": answer}]
    return messages


def data_conversation(prompt: Prompt, ground_truth: str) -> list[dict]:
    """Prompt, the ground truth, then the data's later turns: what the generated conversation is matched to.
    Assistant turns keep role and content only, as on the generated side."""
    messages = prompt_messages(prompt) + [{"role": "assistant", "content": ground_truth}]
    for user, answer in exchanges(prompt):
        messages += [user, {"role": "assistant", "content": answer["content"]}]
    return messages


def render_ids(tokenizer, messages: list[dict], data: DataConfig, generation_prompt: bool) -> list[int]:
    """Token ids of the chat template's rendering, with data.chat_template_kwargs (as data.py renders prompts)."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, return_dict=True,
                                              **data.chat_template_kwargs)["input_ids"])


def first_turn_text(tokenizer, sample: Sample) -> str:
    """The sampled first turn as text, decoded as the producer decodes completions (special tokens dropped)."""
    return tokenizer.decode(sample.token_ids, skip_special_tokens=True)


def feature_sequences(tokenizer, data: DataConfig, group: Group,
                      ground_truth: str) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token ids of each sample's whole generated conversation, then of the data's.

    Each conversation is rendered whole (no generation prompt); its completion is what follows the prompt's
    own rendering with the generation prompt (the longest common prefix, so a template that renders a
    finished assistant turn differently from its generation prompt still splits both sides alike). The
    prompt part is cut from the left to data.max_prompt_length, as data.py cuts prompts."""
    prompt_ids = render_ids(tokenizer, prompt_messages(group.prompt), data, generation_prompt=True)
    expected = len(exchanges(group.prompt))
    conversations = []
    for index, sample in enumerate(group.samples):
        if len(sample.later_turns) != expected:
            raise ValueError(f"ebft: group {group.group_id} sample {index} has {len(sample.later_turns)} generated "
                             f"later turns, its data row {group.prompt.index} has {expected}: the multi-turn "
                             "rollout did not run on it")
        conversations.append(generated_conversation(group.prompt, first_turn_text(tokenizer, sample),
                                                    sample.later_turns))
    conversations.append(data_conversation(group.prompt, ground_truth))
    sequences = []
    for messages in conversations:
        ids = render_ids(tokenizer, messages, data, generation_prompt=False)
        split = _common_prefix(prompt_ids, ids)
        sequences.append((ids[:split][-data.max_prompt_length:], ids[split:]))
    return sequences


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def turn_seed(seed: int, group_id: int, sample_index: int, turn: int) -> int:
    """vLLM seed of later turn `turn` of one sample (driver/rollouts/producer.py's seeds, another namespace)."""
    return zlib.crc32(f"{seed}:turn:{group_id}:{sample_index}:{turn}".encode()) & 0x7FFFFFFF


@dataclass
class _Conversation:
    group: Group
    sample_index: int
    first_turn: str
    generated: list[str] = field(default_factory=list)  # later turns so far


class MultiTurnRollout:
    """The Producer's extend_finished(generator, groups, version) hook for EBFT: sets `later_turns` on
    every sample of the groups with later turns and returns the round's metrics ({} when none has any).

    turn_budget(ground-truth tokens) -> max_tokens is structured.adaptive_max_tokens with the run's config."""

    def __init__(self, config: Config, tokenizer, turn_budget: Callable[[int], int]) -> None:
        self.config, self.tokenizer, self.turn_budget = config, tokenizer, turn_budget
        self._budgets: dict[int, list[int]] = {}  # per data row: max_tokens of each later turn

    def __call__(self, generator: Generator, groups: list[Group], version: int) -> dict[str, float]:
        started = time.perf_counter()
        # In group order, not the order the engine finished them in: the same requests whatever the timing.
        conversations = [_Conversation(group, index, first_turn_text(self.tokenizer, sample))
                         for group in sorted(groups, key=lambda group: group.group_id) if is_multi_turn(group.prompt)
                         for index, sample in enumerate(group.samples)]
        if not conversations:
            return {}
        generated = 0
        for turn in range(max(len(exchanges(c.group.prompt)) for c in conversations)):
            active = [c for c in conversations if turn < len(exchanges(c.group.prompt))]
            for conversation, text in zip(active, self._generate_turn(generator, active, turn, version), strict=True):
                conversation.generated.append(text)
            generated += len(active)
        for conversation in conversations:
            conversation.group.samples[conversation.sample_index].later_turns = tuple(conversation.generated)
        return {"ebft/multi_turn_turns": float(generated), "time/ebft_multi_turn": time.perf_counter() - started}

    def _generate_turn(self, generator: Generator, active: list[_Conversation], turn: int, version: int) -> list[str]:
        """Later turn `turn` of every active conversation: one engine call, n = 1 each, in order."""
        data, seed = self.config.data, self.config.train.seed
        requests = []
        for conversation in active:
            prompt = conversation.group.prompt
            messages = generated_conversation(prompt, conversation.first_turn, conversation.generated)
            messages.append(exchanges(prompt)[turn][0])
            ids = render_ids(self.tokenizer, messages, data, generation_prompt=True)[-data.max_prompt_length:]
            requests.append(Request(ids, 1, turn_seed(seed, conversation.group.group_id, conversation.sample_index,
                                                      turn), self._budget(prompt, turn)))
        where = (f"ebft multi-turn: later turn {turn + 1} of {len(requests)} conversations (data rows "
                 f"{sorted({c.group.prompt.index for c in active})}) with adapter version {version}")
        try:
            results = dict(generator.stream(requests, version))
        except Exception as error:  # the engine's own failure, with what was being generated
            raise RolloutError(f"{where} failed: {type(error).__name__}: {error}") from error
        unanswered = [index for index in range(len(requests)) if not results.get(index)]
        if unanswered:
            raise RolloutError(f"{where}: the engine returned no completion for {len(unanswered)} of them")
        return [self.tokenizer.decode(results[index][0].token_ids, skip_special_tokens=True)
                for index in range(len(requests))]

    def _budget(self, prompt: Prompt, turn: int) -> int:
        if prompt.index not in self._budgets:
            self._budgets[prompt.index] = [
                self.turn_budget(len(self.tokenizer(answer["content"], add_special_tokens=False).input_ids))
                for _, answer in exchanges(prompt)]
        return self._budgets[prompt.index][turn]
