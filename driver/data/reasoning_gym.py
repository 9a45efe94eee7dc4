"""reasoning-gym's procedurally generated tasks as prompts (`data.source: reasoning_gym:<task>`); their
verifier is the reward driver.rewards.reasoning_gym.score (docs/rewards.md "reasoning-gym").

The source is one string: the task, then optionally a query of the task's config fields, e.g.
`reasoning_gym:basic_arithmetic?size=500&seed=3&max_digits=2`. size and seed are fields of every
task's config (reasoning-gym's create_dataset(name, size=..., seed=..., ...)), so they go with the
others rather than into data keys that no other source has; values are read as YAML (3, 0.5, true,
[a, b]); seed defaults to 0 (reasoning-gym's own default is a random seed, which a resumed run could
not reproduce). `system_prompt` is ours, not a config field: the name of one of reasoning-gym's
prompts (utils.SYSTEM_PROMPTS: default, simple, direct, DeepSeekZero, chain_of_draft), or the text
itself; empty for none. Every one asks for the final answer in <answer>...</answer>, which the reward
extracts.

A row is {prompt: [system, user] messages, entry, task}: `entry` is reasoning-gym's entry as generated
({question, answer, metadata}), what the task's score_answer(answer, entry) compares against; `task`
is the canonical source string without the system prompt, from which a reward process rebuilds the
same dataset (task_dataset, cached). Both are JSON-able and pickle exactly, so they reach reward
worker processes unchanged; the entry is kept as generated, not round-tripped through JSON, because
some verifiers compare tuples (ARC's boards: a JSON list would never equal them).

reasoning-gym is imported only here and only when used: a missing install is a ConfigError that
names the pip command.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from urllib.parse import quote, unquote

import yaml

from driver.cli import ConfigError

PREFIX = "reasoning_gym:"
VERSION = "0.1.25"  # the version the adapter is tested with (pyproject.toml's test extra)
DEFAULT_SEED = 0
DEFAULT_SYSTEM_PROMPT = "default"  # reasoning-gym's: think step by step, answer in <answer>...</answer>
SYSTEM_PROMPT_KEY = "system_prompt"  # a query key of ours, not a field of the task's config
QUERY_SAFE = " +,[]{}:/'\""  # left as written in a canonical task; & = % # ? are percent-encoded


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data.source {PREFIX}<task> and the reward driver.rewards.reasoning_gym.score need "
                          f"reasoning-gym: pip install reasoning-gym=={VERSION}") from None
    return reasoning_gym


def split_source(task_source: str) -> tuple[str, dict[str, str]]:
    """'basic_arithmetic?size=5&seed=3' -> ('basic_arithmetic', {'size': '5', 'seed': '3'}), the values as
    written (percent-decoded; '+' stays '+', reasoning-gym's operator)."""
    name, _, query = task_source.partition("?")
    params = {}
    for item in filter(None, query.split("&")):
        key, equals, value = item.partition("=")
        if not equals:
            raise ConfigError(f"data.source {PREFIX}{task_source}: '{item}' is not key=value")
        params[unquote(key)] = unquote(value)
    return name, params


def canonical_task(name: str, params: dict[str, str]) -> str:
    """The task's source string with its seed made explicit and its keys sorted (the `task` column)."""
    params = {"seed": str(DEFAULT_SEED), **params}
    return name + "?" + "&".join(f"{quote(key)}={quote(params[key], safe=QUERY_SAFE)}" for key in sorted(params))


@functools.cache
def task_dataset(task: str):
    """The reasoning-gym dataset a canonical `task` string describes, built once per process."""
    reasoning_gym = import_reasoning_gym()
    name, params = split_source(task)
    registered = reasoning_gym.factory.DATASETS
    if name not in registered:
        close = difflib.get_close_matches(name, registered, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(f"data.source: unknown reasoning-gym task '{name}'; {hint}{len(registered)} tasks, e.g. "
                          f"{', '.join(sorted(registered)[:8])} (all: reasoning_gym.factory.DATASETS)")
    config = {key: config_value(value) for key, value in params.items()}
    try:
        return reasoning_gym.create_dataset(name, **config)
    except (TypeError, ValueError, AssertionError) as error:  # an unknown field, or one its validate() refuses
        fields = sorted(field.name for field in dataclasses.fields(registered[name][1]))
        raise ConfigError(f"data.source {PREFIX}{task}: {type(error).__name__}: {error} (the fields of {name}'s "
                          f"config: {', '.join(fields)})") from None


def config_value(text: str):
    """A query value as YAML (3, 0.5, true, [+, -]), or the text itself where it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def system_message(choice: str) -> list[dict]:
    """[] for an empty choice; one of reasoning-gym's named prompts; otherwise the text itself."""
    if not choice:
        return []
    prompts = import_reasoning_gym().utils.SYSTEM_PROMPTS
    return [{"role": "system", "content": prompts.get(choice, choice)}]


def reasoning_gym_rows(task_source: str) -> list[dict]:
    """Rows of `data.source: reasoning_gym:<task_source>`, one per entry of the dataset."""
    name, params = split_source(task_source)
    system = system_message(params.pop(SYSTEM_PROMPT_KEY, DEFAULT_SYSTEM_PROMPT))
    task = canonical_task(name, params)
    return [{"prompt": [*system, {"role": "user", "content": entry["question"]}], "entry": entry, "task": task}
            for entry in task_dataset(task)]
