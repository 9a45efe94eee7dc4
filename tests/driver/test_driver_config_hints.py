"""An unknown config key's message says where it probably belongs (driver/cli.py): a near spelling,
the same key in another section, or our name for TRL's; TRL_NAMES agrees with the config and the docs."""

import re
from pathlib import Path

import pytest

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.cli import TRL_NAMES, section_keys

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


def test_trl_names_lead_to_keys_that_exist_and_are_not_ours():
    keys = set(section_keys(Config))
    ours = {key.rsplit(".", 1)[-1] for key in keys}
    assert {target for target in TRL_NAMES.values() if target not in keys} == set()
    # a TRL name that is also one of ours is found by name: an entry for it would hide where it is
    assert sorted(name for name in TRL_NAMES if name in ours) == []


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
    rows = [here for trl, here in trl_table_rows() if re.search(rf"\b{name}\b", trl)]
    assert rows, f"docs/coming-from-trl.md's TRL table has no row for {name}"
    last = target.rsplit(".", 1)[-1]
    assert all(target in here or f"`.{last}`" in here for here in rows), (name, target, rows)
