"""Which prompts train and which are evaluated (the eval section): eval.source, read as data.source is, or
eval.val_set_size rows of data.source held out of training (axolotl's val_set_size), chosen by train.seed
so that a resumed run holds out the same ones."""

from __future__ import annotations

import random

from driver.cli import ConfigError
from driver.config import Config, EvalConfig
from driver.data.prompts import PromptSource, load_rows


def training_and_eval_prompts(config: Config, tokenizer,
                              tools: list[dict] | None = None) -> tuple[PromptSource, PromptSource | None]:
    """(the prompts trained on, the prompts evaluated or None without evaluation)."""
    data, evaluation, seed = config.data, config.eval, config.train.seed
    if not evaluation.enabled:
        return PromptSource(data, tokenizer, seed, tools), None
    if evaluation.source is not None:
        eval_rows = list(enumerate(eval_source_rows(config)))
        training = PromptSource(data, tokenizer, seed, tools)
    else:
        rows = load_rows(data)
        kept, eval_rows = hold_out(rows, held_out_count(evaluation, len(rows), data.source), seed)
        training = PromptSource(data, tokenizer, seed, tools, rows=kept)
    eval_data = evaluation.data(data)
    return training, PromptSource(eval_data, tokenizer, seed, tools, rows=eval_rows[:evaluation.max_prompts])


def eval_source_rows(config: Config) -> list[dict]:
    """eval.source's rows after data.transform; its errors name eval.source (load_rows says data.source)."""
    try:
        return load_rows(config.eval.data(config.data))
    except ConfigError as error:
        message = str(error)
        if not message.startswith("data.source"):  # data.prompt_field, data.transform: the shared keys
            raise
        raise ConfigError("eval.source" + message[len("data.source"):]) from error


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
