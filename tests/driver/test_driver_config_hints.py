"""An unknown config key's message says where it probably belongs (driver/cli.py): a near spelling,
the same key in another section, or our name for TRL's; a flat `trl grpo --config` file is refused with
where each of its keys goes (not taken for axolotl's); TRL_NAMES agrees with the config and the docs."""

import re
from pathlib import Path

import pytest
import yaml

from driver.axolotl import is_axolotl_config
from driver.cli import TRL_NAMES, ConfigError, help_text, is_trl_config, load_config, section_keys
from driver.config import Config

TRL_DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from-trl.md"


@pytest.mark.parametrize("overrides,message", [
    ({"train.stepz": "3"}, "train.stepz: unknown key: did you mean train.steps?"),
    ({"model.adaptor": "none"}, "model.adaptor: unknown key: did you mean model.adapter?"),
    ({"algo.importance_sampling.capp": "3"}, "did you mean algo.importance_sampling.cap?"),
    ({"train.beta": "0.1"}, "train.beta: unknown key: did you mean algo.beta?"),
    ({"beta": "0.1"}, "beta: unknown key: did you mean algo.beta?"),  # a flat, TRL-style config
    ({"train.temperature": "0.7"}, "did you mean rollout.sampling.temperature or eval.temperature?"),
    ({"rollout.temprature": "0.7"}, "did you mean rollout.sampling.temperature or eval.temperature?"),
    ({"trian.steps": "3"}, "trian: unknown key: did you mean train?"),
    ({"train.learning_rate": "1e-5"}, "train.learning_rate: unknown key: TRL's learning_rate is train.lr here"),
    ({"max_completion_length": "64"}, "TRL's max_completion_length is rollout.sampling.max_tokens here"),
    ({"rewards.functions": "[{pathh: x}]"}, "rewards.functions.0.pathh: unknown key: did you mean "
                                            "rewards.functions.0.path?"),
    ({"eval.sets": "{held: {sourcee: x}}"}, "eval.sets.held.sourcee: unknown key: did you mean eval.sets.held.source?"),
    ({"logging.colour": "blue"}, "logging.colour: unknown key (see"),  # nothing close: no guess
])
def test_an_unknown_key_names_where_it_probably_belongs(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_trl_names_lead_to_keys_that_exist():
    keys = section_keys(Config)
    assert {target for target in TRL_NAMES.values() if target not in keys} == set()
    # a TRL name that is also ours is found by name; an entry says which of several places it means
    for name, target in TRL_NAMES.items():
        places = [key for key in keys if key.rsplit(".", 1)[-1] == name]
        assert not places or (len(places) > 1 and target in places), (name, target, places)


def trl_table_rows() -> list[tuple[str, str]]:
    """(TRL cell, here cell) of each row of docs/coming-from-trl.md's GRPOConfig table."""
    lines = TRL_DOC.read_text().splitlines()
    start = lines.index("| TRL | here | note |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = line.split(" | ")
        rows.append((cells[0], cells[1]))
    return rows


@pytest.mark.parametrize("name", sorted(TRL_NAMES))
def test_the_trl_table_in_the_docs_says_what_trl_names_says(name):
    target = TRL_NAMES[name]
    # `--name` is a flag of TRL's vllm-serve, another key's row
    rows = [here for trl, here in trl_table_rows() if re.search(rf"(?<![-\w]){name}\b", trl)]
    assert rows, f"docs/coming-from-trl.md's TRL table has no row for {name}"
    section, _, last = target.rpartition(".")
    # the cell names the key whole, as `.key` after another of its section, or as `section.` + same name
    named = [target in here or f"`.{last}`" in here or (name == last and f"`{section}.` + same name" in here)
             for here in rows]
    assert all(named), (name, target, rows)


def test_every_grpoconfig_field_of_the_tested_trl_is_placed():
    """Each field GRPOConfig adds to transformers' TrainingArguments (trl 1.16.0, the test extra) leads to a
    key here (TRL_NAMES, or ours by the same name) or is named in docs/coming-from-trl.md (not here, or
    without effect): a TRL that adds one fails here until the docs say where it went."""
    import dataclasses

    from transformers import TrainingArguments

    from tests.trl_oracle import import_trl

    GRPOConfig = import_trl("trl.trainer.grpo_config").GRPOConfig  # noqa: N806 - TRL's class

    inherited = {field.name for field in dataclasses.fields(TrainingArguments)}
    grpo_fields = [field.name for field in dataclasses.fields(GRPOConfig) if field.name not in inherited]
    assert len(grpo_fields) > 50 and "num_generations" in grpo_fields  # the oracle itself
    ours = {key.rsplit(".", 1)[-1] for key in section_keys(Config)}
    docs = TRL_DOC.read_text()
    unplaced = [name for name in grpo_fields
                if name not in TRL_NAMES and name not in ours and not re.search(rf"`{name}`", docs)]
    assert not unplaced, f"GRPOConfig fields neither mapped nor named in docs/coming-from-trl.md: {unplaced}"


TRL_FILE = """
model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
dataset_name: trl-lib/tldr
learning_rate: 1.0e-5
num_generations: 8
beta: 0.0
seed: 7
use_vllm: true
reward_funcs: [think_format_reward]
push_to_hub_organization: me
"""


def test_a_trl_file_is_refused_with_where_each_of_its_keys_goes(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_FILE)
    with pytest.raises(ConfigError) as error:
        load_config(path, {})
    message = str(error.value)
    assert "holds TRL's flat keys (a `trl grpo --config` file)" in message and "not an axolotl" not in message
    for line in ["model_name_or_path -> model.path", "dataset_name -> data.source", "learning_rate -> train.lr",
                 "num_generations -> algo.num_generations\n", "beta -> algo.beta", "seed -> train.seed",
                 "use_vllm -> rollout.backend", "reward_funcs -> rewards.functions",
                 "push_to_hub_organization -> nothing here by that name"]:
        assert f"  {line}" in message + "\n", line


@pytest.mark.parametrize("config", sorted((Path(__file__).parent / "axolotl_configs").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_axolotl_files_are_not_taken_for_trl_ones(config):
    data = yaml.safe_load(config.read_text())
    assert is_axolotl_config(data) and not is_trl_config(data)


def test_a_trl_key_beside_our_sections_is_our_config_with_a_hint():
    assert not is_trl_config({"train": {"steps": 3}, "beta": 0.1})
    with pytest.raises(ConfigError, match="beta: unknown key: did you mean algo.beta"):
        load_config(None, {"train.steps": "3", "beta": "0.1"})


def test_help_and_the_config_reference_give_trls_names_where_they_differ():
    text = help_text()
    assert "train.lr = " in text and "(TRL: learning_rate)" in text
    assert "(TRL: reward_funcs, reward_weights)" in text
    assert "(TRL: num_generations)" not in text  # the same name: nothing to add
