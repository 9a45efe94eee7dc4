"""Which environment a run uses (the config's `environment` section) and what its prompts must show."""

from __future__ import annotations

import functools

from driver.cli import ConfigError, import_dotted
from driver.config import Config, EnvironmentConfig
from driver.environments.base import EnvironmentFactory
from driver.environments.episodes import EpisodeRunner


def episode_runner(config: Config, tokenizer) -> EpisodeRunner | None:
    """The producer's episodes when the run has an environment (None: one completion per sample, or NeMo Gym
    agent episodes, which the agent server plays whole: driver/rollouts/agent_runs.py)."""
    if config.environment.name in (None, "nemo_gym_agent"):
        return None
    factory, tools = make_factory(config.environment, tokenizer)
    return EpisodeRunner(config, tokenizer, factory, tools)


def prompt_tools(config: Config, tokenizer) -> list[dict] | None:
    """The tools' JSON schemas the chat template renders into every prompt (None: no tools; a NeMo Gym agent's
    come with each row, and the prompt trained on is the one its model server rendered)."""
    if config.environment.name in (None, "nemo_gym_agent"):
        return None
    return make_factory(config.environment, tokenizer)[1] or None


def make_factory(config: EnvironmentConfig, tokenizer) -> tuple[EnvironmentFactory, list[dict]]:
    """(a factory making one environment per episode, the JSON schemas of its tools for the prompt)."""
    if config.name == "tools":
        from driver.environments.tools import ToolCallReader, ToolEnvironment, tool_schemas

        functions = [import_dotted(path, "environment.tools") for path in config.tools]
        try:
            schemas = tool_schemas(functions)
            reader = ToolCallReader(config.tool_parser, tokenizer, schemas)
        except ValueError as error:
            raise ConfigError(str(error)) from error
        return functools.partial(ToolEnvironment, functions, reader, schemas), schemas
    if config.name == "conversation":
        from driver.environments.conversation import ConversationEnvironment

        return functools.partial(ConversationEnvironment, config.user_turns_field), []
    factory = import_dotted(config.name, "environment.name")
    try:
        tools = list(getattr(factory(**config.kwargs), "tools", []) or [])
    except TypeError as error:
        raise ConfigError(f"environment.name = {config.name}: calling it with environment.kwargs "
                          f"{sorted(config.kwargs)} failed: {error}") from error
    return functools.partial(factory, **config.kwargs), tools
