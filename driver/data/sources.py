"""Where prompts come from: a built-in toy set, a reasoning-gym task (driver/data/reasoning_gym.py), a
local file, a local dataset directory (a Hub dataset repository's layout: data files, optionally a
README.md whose `configs:` name them), or a Hugging Face Hub dataset by id (`org/name`), loaded with
`datasets` (its cache, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, apply as everywhere: an offline run
finds a dataset downloaded before)."""

from __future__ import annotations

from pathlib import Path

from driver.cli import ConfigError
from driver.config import DATA_FILE_FORMATS, DataConfig
from driver.data.reasoning_gym import reasoning_gym_rows
from driver.data.toy_tasks import toy_dataset


def load_source_rows(config: DataConfig) -> list[dict]:
    try:
        kind = config.source_kind()
    except ValueError as error:
        raise ConfigError(f"data.source: {error}") from None
    if kind == "toy":
        return toy_dataset(config.source[len("toy:"):])
    if kind == "reasoning_gym":
        return reasoning_gym_rows(config.source[len("reasoning_gym:"):])
    import datasets

    if kind == "file":
        path = Path(config.source)
        if path.stat().st_size == 0:  # datasets' own error for this is a bare StopIteration
            raise ConfigError(f"data.source: {path} is empty")
        builder = DATA_FILE_FORMATS[path.suffix]
        try:
            return list(datasets.load_dataset(builder, data_files=str(path), split="train"))
        except (datasets.exceptions.DatasetsError, ValueError, OSError) as error:
            # DatasetGenerationError says only "an error occurred": the parser's message is its cause
            cause = error.__cause__ or error
            raise ConfigError(f"data.source: {path} could not be read as {builder}: "
                              f"{type(cause).__name__}: {cause}") from None
    where = f"data.source {config.source}" + (f" (name {config.name})" if config.name else "")
    try:
        dataset = datasets.load_dataset(config.source, name=config.name, split=config.split,
                                        revision=config.revision if kind == "hub" else None)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as error:
        offline = " (offline: only datasets already in the cache load)" if datasets.config.HF_HUB_OFFLINE else ""
        raise ConfigError(f"{where}, split {config.split}: {type(error).__name__}: {error}{offline}") from None
    return list(dataset)
