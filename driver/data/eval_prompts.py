"""Which prompts train and which are evaluated (the eval section): eval.source, read as data.source is, or
eval.val_set_size rows of data.source held out of training (axolotl's val_set_size), chosen by train.seed
so that a resumed run holds out the same ones."""

from __future__ import annotations

import random

from driver.cli import ConfigError
from driver.config import Config, EvalConfig
from driver.data.prompts import PromptSource, load_rows


def training_and_eval_prompts(config: Config, tokenizer, tools: list[dict] | None = None
                              ) -> tuple[PromptSource, dict[str, PromptSource] | None]:
    """(the prompts trained on, the prompts evaluated by set label or None without evaluation): {"": prompts} for
    eval.source or val_set_size, a label each for eval.sets."""
    data, evaluation, seed = config.data, config.eval, config.train.seed
    if not evaluation.enabled:
        return PromptSource(data, tokenizer, seed, tools), None
    if evaluation.val_set_size:
        rows = load_rows(data)
        kept, held = hold_out(rows, held_out_count(evaluation, len(rows), data.source), seed)
        sets = {"": held}
        training = PromptSource(data, tokenizer, seed, tools, rows=kept)
    else:
        sets = {label: list(enumerate(eval_source_rows(config, label))) for label in evaluation.labels()}
        training = PromptSource(data, tokenizer, seed, tools)
    return training, {label: PromptSource(evaluation.data(data, label), tokenizer, seed, tools,
                                          rows=rows[:evaluation.max_prompts]) for label, rows in sets.items()}


def eval_source_rows(config: Config, label: str = "") -> list[dict]:
    """eval.source's (or eval.sets' `label`'s) rows after data.transform; its errors name that key (load_rows says
    data.source)."""
    try:
        return load_rows(config.eval.data(config.data, label))
    except ConfigError as error:
        message = str(error)
        if not message.startswith("data.source"):  # data.prompt_field, data.transform: the shared keys
            raise
        key = f"eval.sets.{label}.source" if label else "eval.source"
        raise ConfigError(key + message[len("data.source"):]) from error


def held_out_count(evaluation: EvalConfig, rows: int, source: str) -> int:
    count = evaluation.held_out(rows)
    if not 0 < count < rows:
        raise ConfigError(f"eval.val_set_size = {evaluation.val_set_size} holds out {count} of the {rows} prompts of "
                          f"{source}: at least one must be evaluated and one trained on")
    return count


def hold_out(rows: list[dict], count: int, seed: int) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """(kept, held out): `count` rows drawn by `seed`, each side as (row index, row) in the rows' order."""
    chosen = set(random.Random(f"{seed}:eval").sample(range(len(rows)), count))
    numbered = list(enumerate(rows))
    return [item for item in numbered if item[0] not in chosen], [item for item in numbered if item[0] in chosen]
