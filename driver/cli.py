"""Command line: `python -m driver.train [cfg.yaml] [--from axolotl] [--section.key=value ...] [--help]`.

Every config mistake (unknown key, wrong type, missing file, unimportable function) becomes one
message naming the key and exits with status 2 — no traceback. An unknown key's message says where it
probably belongs: a near spelling in its section, the same key in another section, or our name for
TRL's (GRPOConfig's flat names: TRL_NAMES; docs/coming-from-trl.md has the whole table, which a test
keeps in step with it). An axolotl config (recognized by its keys, or named so with --from axolotl)
is translated first (driver/axolotl/) and the translation printed; overrides then apply to the
translation. A `trl grpo --config` file (TRL's flat keys) is not translated: it is refused with where
each of its keys goes here.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from driver.axolotl import AXOLOTL_MARKERS, UntranslatableConfig, is_axolotl_config, translate, translation_yaml
from driver.config import Config, is_hub_id

USAGE = "usage: python -m driver.train [config.yaml] [--from axolotl] [--section.key=value ...] [--help]"
SOURCE_FORMATS = ("axolotl",)  # --from: configs of other trainers that are translated into ours


class ConfigError(Exception):
    """A user-facing config problem; main() prints it and exits with status 2."""


def parse_args(argv: list[str]) -> tuple[Path | None, dict[str, str], bool, str | None]:
    """(config path, overrides, --help given, --from's format)."""
    config_path, overrides, show_help, source_format = None, {}, False, None
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            show_help = True
        elif arg == "--from" or arg.startswith("--from="):
            source_format = arg.partition("=")[2] if "=" in arg else next(args, None)
            if source_format not in SOURCE_FORMATS:
                raise ConfigError(f"--from takes {' | '.join(SOURCE_FORMATS)}, got {source_format!r}\n{USAGE}")
        elif arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            if not sep or not key:
                raise ConfigError(f"override {arg!r} must look like --section.key=value\n{USAGE}")
            overrides[key] = value
        elif config_path is None:
            config_path = Path(arg)
        else:
            raise ConfigError(f"unexpected argument {arg!r} (one config file only)\n{USAGE}")
    return config_path, overrides, show_help, source_format


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, train:, ...), got {type(data).__name__}")
    return data


def apply_override(data: dict[str, Any], dotted_key: str, raw_value: str) -> None:
    """Set data[a][b][c] = value for "a.b.c"; the value is parsed as YAML (so 1e-4, true, [a, b] work)."""
    parts = dotted_key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted_key}: '{part}' is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(raw_value) if raw_value != "" else None
    except yaml.YAMLError:
        node[parts[-1]] = raw_value


# GRPOConfig's names (and TRL's vllm-serve's) whose key here is named otherwise. A TRL name that is also
# ours (beta, epsilon, ...) needs no entry, it is found by name, unless ours is in several sections: then the
# entry says which one TRL's means (a flat TRL file's map uses it; an unknown key's hint lists them all).
TRL_NAMES = {
    # ours in several sections: TRL's is
    "seed": "train.seed",
    "temperature": "rollout.sampling.temperature",
    "num_generations": "algo.num_generations",
    "dtype": "model.dtype",
    # named otherwise here
    "learning_rate": "train.lr",
    "max_steps": "train.steps",
    "num_train_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "generation_batch_size": "train.prompts_per_step",
    "lr_scheduler_type": "train.schedule",
    "max_completion_length": "rollout.sampling.max_tokens",
    "use_vllm": "rollout.backend",
    "vllm_mode": "rollout.backend",
    "vllm_server_base_url": "rollout.server_url",
    "vllm_server_host": "rollout.server_url",
    "vllm_server_port": "rollout.server_url",
    "vllm_server_timeout": "rollout.server_timeout",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "vllm_max_model_length": "rollout.max_model_len",
    "vllm_tensor_parallel_size": "rollout.tensor_parallel_size",
    "vllm_enable_sleep_mode": "rollout.enable_sleep_mode",
    "vllm_structured_outputs_regex": "rollout.sampling.structured_outputs",
    "vllm_importance_sampling_correction": "algo.importance_sampling.level",
    "vllm_importance_sampling_mode": "algo.importance_sampling.mode",
    "vllm_importance_sampling_clip_max": "algo.importance_sampling.cap",
    "vllm_importance_sampling_clip_min": "algo.importance_sampling.cap_min",
    "vllm_importance_sampling_cap": "algo.importance_sampling.cap",  # TRL's former name of clip_max
    "reward_funcs": "rewards.functions",
    "reward_weights": "rewards.functions",
    "multi_objective_aggregation": "rewards.aggregation",
    "shuffle_dataset": "data.shuffle",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "model_revision": "model.revision",
    "max_tool_calling_iterations": "environment.max_turns",
    "num_completions_to_print": "logging.log_completions",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "resume_from_checkpoint": "checkpoint.resume",
    "load_best_model_at_end": "eval.save_best",
    "metric_for_best_model": "eval.best_metric",
    "eval_dataset": "eval.source",
    "eval_steps": "eval.steps",
    "eval_on_start": "eval.on_start",
    "num_generations_eval": "eval.num_generations",
    # ModelConfig's and ScriptArguments' (trl grpo --config files hold them beside GRPOConfig's)
    "model_name_or_path": "model.path",
    "torch_dtype": "model.dtype",
    "use_peft": "model.adapter",
    "load_in_4bit": "model.qlora",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.targets",
    "use_rslora": "lora.rslora",
    "dataset_name": "data.source",
    "dataset_config": "data.name",
    "dataset_train_split": "data.split",
    "dataset_test_split": "eval.split",
}
# Top-level keys of a `trl grpo --config` file that an axolotl config keeps elsewhere (under trl:, or as
# base_model, datasets, adapter): one of them, none of our sections and none of axolotl's own keys make a
# flat file TRL's. The keys both put at the top are TRL_AND_AXOLOTL.
TRL_MARKERS = frozenset({"model_name_or_path", "dataset_name", "reward_funcs", "use_vllm", "vllm_mode", "use_peft",
                         "per_device_train_batch_size", "num_generations", "max_completion_length", "beta",
                         "loss_type"})
TRL_AND_AXOLOTL = frozenset({"learning_rate", "max_steps", "gradient_accumulation_steps", "lora_r"})


def _nested_model(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds: itself, or inside Optional / list / dict."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def section_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of model's plain sections (not inside a list or dict of them), sections included."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        nested = _nested_model(field.annotation)
        if nested is not None and get_origin(field.annotation) not in (list, dict):
            keys += section_keys(nested, prefix + name + ".")
    return keys


@functools.cache
def keys_by_name(root: type[BaseModel]) -> dict[str, list[str]]:
    """section_keys(root) by their last part (train.lr under lr), in the config's order."""
    places: dict[str, list[str]] = {}
    for key in section_keys(root):
        places.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    return places


def _model_at(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The model that holds the keys at pydantic's error location `path` (list indices and dict keys
    skipped), or None where the path leaves the models."""
    model, inside_dict = root, False
    for part in path:
        if isinstance(part, int) or inside_dict or (model is not None and part == model.__name__):
            inside_dict = False
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        model, inside_dict = _nested_model(field.annotation), get_origin(field.annotation) is dict
    return model


def unknown_key_hint(root: type[BaseModel], location: tuple) -> str:
    """Where the unknown key at `location` (pydantic's error loc, the key last) probably belongs, as
    ': did you mean x?' or ": TRL's y is x here", or '' when nothing is close. In that order: TRL's name,
    the same name in another section, a near spelling in its own section, then in any section."""
    name, parent = location[-1], location[:-1]
    if not isinstance(name, str):
        return ""
    by_name = keys_by_name(root)
    if name in TRL_NAMES and name not in by_name:
        return f": TRL's {name} is {TRL_NAMES[name]} here"
    prefix = "".join(f"{part}." for part in parent)
    candidates = [key for key in by_name.get(name, []) if key != prefix + name]
    if not candidates:
        model = _model_at(root, parent)
        close = difflib.get_close_matches(name, list(model.model_fields), n=2, cutoff=0.75) if model else []
        candidates = [prefix + key for key in close]
    if not candidates:
        close = difflib.get_close_matches(name, list(by_name), n=2, cutoff=0.8)
        candidates = [key for match in close for key in by_name[match]]
    return f": did you mean {' or '.join(candidates)}?" if candidates else ""


def is_trl_config(data: dict) -> bool:
    """TRL's flat keys, and none of our sections or of axolotl's own keys."""
    return (bool(data.keys() & TRL_MARKERS) and not data.keys() & (AXOLOTL_MARKERS - TRL_AND_AXOLOTL)
            and not data.keys() & Config.model_fields.keys())


def trl_config_error(data: dict, path: Path | None) -> ConfigError:
    """A TRL file is not translated (an axolotl one is): the error names where each of its keys goes here."""
    places = keys_by_name(Config)
    lines = [f"  {name} -> {TRL_NAMES.get(name) or ' or '.join(places.get(name, [])) or 'nothing here by that name'}"
             for name in data]
    return ConfigError(f"{path or 'the config'} holds TRL's flat keys (a `trl grpo --config` file); ours are in "
                       "sections, and a TRL file is not translated. Where each key goes (docs/coming-from-trl.md "
                       "has the table, and says where a value means something else here):\n" + "\n".join(lines))


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "config"
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = (f"unknown key{unknown_key_hint(Config, tuple(problem['loc']))} (see `python -m driver.train "
                       "--help` for the keys)")
        elif "input" in problem and problem["type"] not in ("missing",):
            message += f" (got {problem['input']!r})"
        lines.append(f"  {key}: {message}")
    return "invalid config:\n" + "\n".join(lines)


# Modules configs name that moved when the driver became packages: they keep working, with one
# warning giving the new name.
MOVED_MODULES = {"driver.reward_functions": "driver.data.gsm8k", "driver.toy_tasks": "driver.data.toy_tasks",
                 "driver.data.axolotl_transforms": "driver.axolotl.transforms"}


# TRL's built-in rewards (trl.rewards) by the name a TRL script passes, and ours of that name. A bare name in a
# path, or trl.rewards.<name> without trl installed, gets this in its error.
TRL_REWARDS = {name: f"driver.rewards.builtin.{name}" for name in (
    "think_format_reward", "accuracy_reward", "reasoning_accuracy_reward")}
TRL_REWARDS.update({name: f"driver.rewards.builtin.{name} (with its kwargs)" for name in (
    "get_soft_overlong_punishment", "get_cosine_scaled_reward", "get_repetition_penalty_reward")})


def trl_reward_hint(path: str) -> str:
    name = path.removeprefix("trl.rewards.")
    hint = TRL_REWARDS.get(name)
    return "" if hint is None else f" (TRL's {name} is {hint})"


def import_dotted(path: str, what: str):
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"{what}: {path!r} must be a dotted path like package.module.function{trl_reward_hint(path)}")
    if module_name in MOVED_MODULES:
        module_name = MOVED_MODULES[module_name]
        warnings.warn(f"{what}: {path} is now {module_name}.{attribute} (the old name will go away)", FutureWarning,
                      stacklevel=2)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"{what}: cannot import module '{module_name}' ({error}){trl_reward_hint(path)}") from None
    if not hasattr(module, attribute):
        raise ConfigError(f"{what}: module '{module_name}' has no '{attribute}'")
    function = getattr(module, attribute)
    if not callable(function):
        raise ConfigError(f"{what}: {path} is not callable")
    return function


def reward_function(path: str, kwargs: dict | None, what: str):
    """The function `path` names, or with kwargs what the factory `path` names returns for them."""
    function = import_dotted(path, what)
    if kwargs is None:
        return function
    try:
        function = function(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{what}: {path}(**{kwargs}) failed: {error}") from None
    if not callable(function):
        raise ConfigError(f"{what}: {path}(**{kwargs}) returned {type(function).__name__}, not a reward function")
    return function


def check_references(config: Config) -> None:
    """Files and dotted paths the config names must exist before anything heavy starts."""
    for index, function in enumerate(config.rewards.functions):
        if function.path is not None:
            reward_function(function.path, function.kwargs, f"rewards.functions[{index}].path")
        elif not Path(function.model).is_dir() and not is_hub_id(function.model):
            raise ConfigError(f"rewards.functions[{index}].model: {function.model} is neither a local model directory "
                              "nor a Hub model id (org/name)")
    if config.data.transform:
        import_dotted(config.data.transform, "data.transform")
    try:
        config.data.source_kind()  # a toy set, a file, a directory or a Hub id
    except ValueError as error:
        raise ConfigError(f"data.source: {error}") from None
    if config.eval.source is not None:
        try:
            config.eval.data(config.data).source_kind()
        except ValueError as error:
            raise ConfigError(f"eval.source: {error}") from None
    model_path = config.model.path
    hub = is_hub_id(model_path)
    if not model_path.startswith("tiny://") and not Path(model_path).is_dir() and not hub:
        raise ConfigError(f"model.path: {model_path} is neither a local model directory nor a Hugging Face Hub model "
                          "id (org/name), nor tiny://qwen2")
    if config.model.revision is not None and not hub:
        raise ConfigError(f"model.revision: {config.model.revision} applies to a Hub model id; model.path "
                          f"{model_path} is not one")


def load_config(path: Path | None, overrides: dict[str, str], source_format: str | None = None) -> Config:
    data = read_yaml(path) if path is not None else {}
    if source_format is None and is_trl_config(data):
        raise trl_config_error(data, path)
    axolotl = source_format == "axolotl" or (source_format is None and is_axolotl_config(data))
    axolotl_keys = [] if axolotl else sorted(data.keys() & AXOLOTL_MARKERS)
    if axolotl:
        data = from_axolotl(data, path)
    for key, value in overrides.items():
        apply_override(data, key, value)
    try:
        config = Config.model_validate(data)
    except ValidationError as error:
        hint = (f"\n  ({', '.join(axolotl_keys)}: axolotl's keys; a whole axolotl config, without our sections, is "
                "translated: see --from axolotl)" if axolotl_keys else "")
        raise ConfigError(format_validation_error(error) + hint) from None
    check_references(config)
    return config


def from_axolotl(data: dict, path: Path | None) -> dict:
    """Our config for an axolotl one; its YAML goes to stdout (by rank 0 alone under torchrun), for the
    user to keep and run as it is."""
    try:
        translation = translate(data)
    except UntranslatableConfig as error:
        raise ConfigError(f"{path or 'the config'}: {error}") from None
    if os.environ.get("RANK", "0") == "0":
        print(translation_yaml(translation, str(path or "the config")), flush=True)
    return translation.config


def help_text() -> str:
    lines = [USAGE, "", "Config keys (YAML sections; override any with --section.key=value):"]
    _describe(Config, "", lines)
    return "\n".join(lines)


def _describe(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    for name, field in model.model_fields.items():
        key = prefix + name
        annotation = field.annotation
        nested = _nested_model(annotation)
        if nested is not None and get_origin(annotation) not in (list, dict):  # a list or dict of them: one key
            lines.append(f"\n  {key}: {field.description}")
            _describe(nested, key + ".", lines)
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [item.model_dump(exclude_none=True) for item in default]
        # TRL's names for it where they are not its own, unless its help says them already
        trl = [trl_name for trl_name, target in TRL_NAMES.items()
               if target == key and trl_name != name and trl_name not in field.description]
        trl_note = f" (TRL: {', '.join(trl)})" if trl else ""
        lines.append(f"    {key} = {default!r}\n        {field.description}{trl_note}")
        if nested is not None:
            for sub_name, sub_field in nested.model_fields.items():
                lines.append(f"        - {sub_name}: {sub_field.description}")


def markdown_reference() -> str:
    """docs/config.md: every key, its default and its help, one table per section."""
    lines = ["# Config reference", "",
             "Generated from driver/config.py by `python -m driver.cli > docs/config.md` (a test keeps it in sync).",
             "Override any key on the command line with `--section.key=value`."]
    for name, field in Config.model_fields.items():
        lines += ["", f"## {name}", "", field.description + ".", "", "| key | default | meaning |", "|---|---|---|"]
        rows: list[str] = []
        _describe(_nested_model(field.annotation), name + ".", rows)
        lines += [_markdown_row(row) for row in rows if " = " in row]
    return "\n".join(lines) + "\n"


def _markdown_row(entry: str) -> str:
    head, _, meaning = entry.partition("\n")
    key, _, default = head.strip().partition(" = ")
    return f"| `{key}` | `{default}` | {meaning.strip().replace('|', '/')} |"


def config_from_argv(argv: list[str]) -> Config | None:
    """The validated config, or None when --help was printed. Raises ConfigError."""
    path, overrides, show_help, source_format = parse_args(argv)
    if show_help:
        print(help_text())
        return None
    return load_config(path, overrides, source_format)


def exit_on_config_error(error: ConfigError) -> None:
    """Exit 2 with the message. Under torchrun every rank finds the same error: rank 0 alone says it
    (torchrun's RANK; the process group may not exist yet)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    print(markdown_reference(), end="")
