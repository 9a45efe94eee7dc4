"""Prompts: a local dataset file (via `datasets`) or a built-in toy set, tokenized once, served in a
seeded order whose position is part of every checkpoint (resume continues with the next prompt).

A prompt is text, or a conversation (a list of {"role", "content"} chat messages, e.g. from
driver.ebft.transforms) that is always rendered with the tokenizer's chat template."""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field

from driver.cli import ConfigError, import_dotted
from driver.config import DataConfig
from driver.data.sources import load_source_rows


@dataclass
class Prompt:
    index: int  # row in the dataset (after the transform)
    text: str  # the prompt text, or a conversation rendered with the chat template
    token_ids: list[int]
    columns: dict = field(default_factory=dict)  # every column, passed to the reward functions
    messages: list[dict] | None = None  # the conversation, when the prompt was one (rewards then get messages)


def load_rows(config: DataConfig) -> list[dict]:
    rows = load_source_rows(config)
    if config.transform:
        rows = apply_transform(rows, config.transform, config)
    if not rows:
        raise ConfigError(f"data.source: {config.source} has no rows")
    missing = [i for i, row in enumerate(rows) if not is_prompt(row.get(config.prompt_field))]
    if missing:
        raise ConfigError(f"data.prompt_field: {len(missing)} rows (first: row {missing[0]}) have no text column "
                          f"'{config.prompt_field}' (it must hold text or a list of chat messages "
                          f"{{'role': str, 'content': str}}); columns are {sorted(rows[missing[0]])}")
    return rows


def apply_transform(rows: list[dict], dotted_path: str, config: DataConfig | None = None) -> list[dict]:
    """A transform returns a dict, or a list of dicts that replace the row in order (e.g. one row per
    assistant turn of a conversation; an empty list drops the row). axolotl's transforms are accepted as
    they are: fn(cfg, *args, **kwargs) -> (map_fn, {"remove_columns": [...]}), see axolotl_transform."""
    transform = import_dotted(dotted_path, "data.transform")
    if is_axolotl_transform(transform):
        transform = axolotl_transform(transform, dotted_path, config)
    transformed = []
    for index, row in enumerate(rows):
        try:
            result = transform(dict(row))
        except ValueError as error:  # a bad row: say which, the transform cannot know its index
            raise ConfigError(f"data.transform: {dotted_path} rejected row {index}: {error}") from error
        results = result if isinstance(result, list) else [result]
        if not all(isinstance(r, dict) for r in results):
            raise ConfigError(f"data.transform: {dotted_path} must return a dict or a list of dicts, got "
                              f"{type(result).__name__} for row {index}")
        transformed.extend(results)
    return transformed


def is_axolotl_transform(transform) -> bool:
    """axolotl's dataset transforms are factories whose first parameter is the config, named cfg."""
    try:
        parameters = list(inspect.signature(transform).parameters)
    except (TypeError, ValueError):
        return False
    return bool(parameters) and parameters[0] == "cfg"


def axolotl_transform(factory, dotted_path: str, config: DataConfig | None):
    """An axolotl transform as a row transform: factory(cfg) gives (map_fn, {"remove_columns": [...]});
    like datasets.map, remove_columns (a list, one name, or axolotl's "__all__": every column) leave the
    row, then what map_fn returns is added (a returned column is kept even if it was removed).
    cfg is the data section here (axolotl passes its whole config; its GRPO transforms ignore it)."""
    made = factory(config)
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0]) and isinstance(made[1], dict)):
        raise ConfigError(f"data.transform: {dotted_path}(cfg) looks like an axolotl transform (its first "
                          f"parameter is cfg) but returned {type(made).__name__}, not (map_fn, "
                          "{'remove_columns': [...]})")
    map_fn, options = made
    removed = options.get("remove_columns") or []
    removed = {removed} if isinstance(removed, str) else set(removed)

    def transform(row: dict) -> dict:
        kept = {} if "__all__" in removed else {key: value for key, value in row.items() if key not in removed}
        return {**kept, **map_fn(dict(row))}

    return transform


def is_prompt(value) -> bool:
    """Text, or a non-empty conversation of {"role": str, "content": str} messages."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


def chat_token_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    # return_dict=True said explicitly: transformers 5 returns a BatchEncoding by default, 4.x a list.
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                              **template_kwargs)["input_ids"])


class PromptSource:
    """Endless, epoch-shuffled prompts. state_dict()/load_state_dict() make the order resumable."""

    def __init__(self, config: DataConfig, tokenizer, seed: int, tools: list[dict] | None = None,
                 rows: list[tuple[int, dict]] | None = None) -> None:
        """tools: JSON schemas the chat template renders into every prompt (an environment's tools). rows: (row
        index, row) to serve instead of all of config.source's (driver/data/eval_prompts.py holds some out)."""
        self.config, self.seed = config, seed
        self.tools = tools
        self.has_chat_template = getattr(tokenizer, "chat_template", None) is not None
        rows = rows if rows is not None else list(enumerate(load_rows(config)))
        self.prompts = [self._tokenize(i, row, tokenizer) for i, row in rows]
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _tokenize(self, index: int, row: dict, tokenizer) -> Prompt:
        prompt = row[self.config.prompt_field]
        template_kwargs = dict(self.config.chat_template_kwargs)
        if self.tools:
            template_kwargs["tools"] = self.tools
        if (isinstance(prompt, list) or self.config.chat_template) and not self.has_chat_template:
            need = "is a conversation, which needs" if isinstance(prompt, list) else "needs (data.chat_template: true)"
            raise ConfigError(f"data: row {index} {need} the chat template, but the model's tokenizer has none; "
                              "give prompts as text with data.chat_template: false, or a model whose "
                              "tokenizer_config.json has a chat_template")
        if isinstance(prompt, list):  # a conversation has no meaning without the chat template
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                 **template_kwargs)
            ids = chat_token_ids(tokenizer, prompt, **template_kwargs)
        elif self.config.chat_template:
            text, ids = prompt, chat_token_ids(tokenizer, [{"role": "user", "content": prompt}], **template_kwargs)
        else:
            text, ids = prompt, tokenizer(prompt, add_special_tokens=False).input_ids
        ids = ids[-self.config.max_prompt_length:]  # keep the end: it holds the question
        return Prompt(index=index, text=text, token_ids=list(ids), columns=dict(row),
                      messages=list(prompt) if isinstance(prompt, list) else None)

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.config.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Prompt]:
        batch = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    def epochs_drawn(self) -> float:
        """Passes over the prompts drawn so far (fractional): TRL's epoch, as reward functions see it."""
        return self.epoch + self.position / max(len(self.prompts), 1)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """ValueError when the checkpoint's order cannot continue over these prompts: it was taken over
        another number of them (checkpoints from before the count say it only by a position past the end)."""
        count = int(state.get("prompts", len(self.prompts)))
        if count != len(self.prompts) or int(state["position"]) > len(self.prompts):
            raise ValueError(f"data.source: the checkpoint was taken over {state.get('prompts', 'other')} prompts, "
                             f"{self.config.source} gives {len(self.prompts)}: resume with the data it trained on")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()
