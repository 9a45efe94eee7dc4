"""Prompts: a local dataset file (via `datasets`) or a built-in toy set, tokenized once, served in a
seeded order whose position is part of every checkpoint (resume continues with the next prompt)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from driver.cli import ConfigError, import_dotted
from driver.config import DataConfig
from driver.toy_tasks import toy_dataset

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Prompt:
    index: int  # row in the dataset
    text: str
    token_ids: list[int]
    columns: dict = field(default_factory=dict)  # every column, passed to the reward functions


def load_rows(config: DataConfig) -> list[dict]:
    if config.source.startswith("toy:"):
        rows = toy_dataset(config.source[len("toy:"):])
    else:
        path = Path(config.source)
        if path.suffix not in FILE_FORMATS:
            raise ConfigError(f"data.source: {path} must end with one of {', '.join(FILE_FORMATS)}")
        import datasets

        rows = list(datasets.load_dataset(FILE_FORMATS[path.suffix], data_files=str(path), split="train"))
    if config.transform:
        transform = import_dotted(config.transform, "data.transform")
        rows = [transform(dict(row)) for row in rows]
    if not rows:
        raise ConfigError(f"data.source: {config.source} has no rows")
    missing = [i for i, row in enumerate(rows) if not isinstance(row.get(config.prompt_field), str)]
    if missing:
        raise ConfigError(f"data.prompt_field: {len(missing)} rows (first: row {missing[0]}) have no text column "
                          f"'{config.prompt_field}'; columns are {sorted(rows[missing[0]])}")
    return rows


class PromptSource:
    """Endless, epoch-shuffled prompts. state_dict()/load_state_dict() make the order resumable."""

    def __init__(self, config: DataConfig, tokenizer, seed: int) -> None:
        self.config, self.seed = config, seed
        self.prompts = [self._tokenize(i, row, tokenizer) for i, row in enumerate(load_rows(config))]
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _tokenize(self, index: int, row: dict, tokenizer) -> Prompt:
        text = row[self.config.prompt_field]
        if self.config.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            ids = tokenizer(text, add_special_tokens=False).input_ids
        ids = ids[-self.config.max_prompt_length:]  # keep the end: it holds the question
        return Prompt(index=index, text=text, token_ids=list(ids), columns=dict(row))

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

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order()
