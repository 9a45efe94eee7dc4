"""Prompt sources (toy, jsonl/csv/parquet, transform, resumable order) and reward tables."""

import json
import math

import pytest
import torch

from driver.cli import ConfigError
from driver.config import DataConfig, RewardFunction, RewardsConfig
from driver.data.prompts import PromptSource, load_rows
from driver.data.tiny_model import resolve_model_path
from driver.data.toy_tasks import digit_fraction
from driver.rewards.functions import RewardError, RewardFunctions

HERE = "tests.driver.data.test_driver_data_rewards"  # this module, as the config names functions in it


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))


def write_rows(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif path.suffix == ".csv":
        keys = list(rows[0])
        path.write_text("\n".join([",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in rows]))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_local_files(tmp_path, suffix):
    path = write_rows(tmp_path / f"data{suffix}", [{"question": f"q{i}", "answer": str(i)} for i in range(5)])
    rows = load_rows(DataConfig(source=str(path), prompt_field="question"))
    assert [r["question"] for r in rows] == [f"q{i}" for i in range(5)]


def build_prompt(example: dict) -> dict:
    return {**example, "prompt": f"Q: {example['question']} A:"}


def test_transform_and_missing_prompt_field(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"question": "2+2", "answer": "4"}])
    rows = load_rows(DataConfig(source=str(path), transform=f"{HERE}.build_prompt"))
    assert rows[0]["prompt"] == "Q: 2+2 A:"
    with pytest.raises(ConfigError, match="data.prompt_field: 1 rows .* have no text column 'prompt'"):
        load_rows(DataConfig(source=str(path)))


def test_unknown_toy_set_and_format(tmp_path):
    with pytest.raises(ValueError, match="unknown toy dataset 'toy:chess'"):
        load_rows(DataConfig(source="toy:chess"))
    bad = tmp_path / "d.txt"
    bad.write_text("x")
    with pytest.raises(ConfigError, match="must end with one of"):
        load_rows(DataConfig(source=str(bad)))


def test_order_is_seeded_epoch_shuffled_and_resumable(tokenizer):
    source = PromptSource(DataConfig(), tokenizer, seed=3)
    first = [p.index for p in source.next_batch(300)]  # crosses the 256-row epoch boundary
    assert sorted(first[:256]) == list(range(256)) and first[:256] != list(range(256))
    state = source.state_dict()
    expected = [p.index for p in source.next_batch(20)]
    resumed = PromptSource(DataConfig(), tokenizer, seed=3)
    resumed.load_state_dict(state)
    assert [p.index for p in resumed.next_batch(20)] == expected
    assert [p.index for p in PromptSource(DataConfig(), tokenizer, seed=4).next_batch(10)] != first[:10]


def test_an_order_taken_over_other_data_is_refused_by_key(tokenizer, tmp_path):
    """Resumed over another data.source the saved position would index past the end (an IndexError steps
    later) or continue another dataset's order: named at load instead."""
    source = PromptSource(DataConfig(), tokenizer, seed=3)
    source.next_batch(10)
    three = tmp_path / "three.jsonl"
    three.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(3)))
    other = PromptSource(DataConfig(source=str(three)), tokenizer, seed=3)
    with pytest.raises(ValueError, match=f"data.source: the checkpoint was taken over 256 prompts, {three} gives 3"):
        other.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="taken over other prompts"):  # a checkpoint from before the count
        other.load_state_dict({"epoch": 0, "position": 10})
    other.load_state_dict({"epoch": 1, "position": 2})  # before the count, and within these prompts: loads


def test_prompts_are_cut_from_the_left(tokenizer):
    source = PromptSource(DataConfig(max_prompt_length=3), tokenizer, seed=0)
    prompt = source.prompts[0]
    assert prompt.token_ids == tokenizer(prompt.text, add_special_tokens=False).input_ids[-3:]


def test_digit_fraction():
    assert digit_fraction(["p"] * 4, ["12 a", "", " \n", "abc"]) == [2 / 3, 0.0, 0.0, 0.0]


def constant_rewards(prompts, completions, **columns):
    return [float(len(c)) if c else None for c in completions]


def uses_columns(prompts, completions, answer, **columns):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def wrong_length(prompts, completions, **columns):
    return [1.0]


def not_a_number(prompts, completions, **columns):
    return ["yes" for _ in completions]


def test_reward_table_nan_for_none_and_columns_passed():
    config = RewardsConfig(functions=[RewardFunction(path=f"{HERE}.constant_rewards"),
                                      RewardFunction(path=f"{HERE}.uses_columns", weight=2.0, name="exact")])
    rewards = RewardFunctions(config)
    table = rewards(prompts=["a", "b"], completions=["xy", ""], columns=[{"answer": "xy"}, {"answer": "z"}],
                    completion_ids=[[1, 2], []])
    assert rewards.names == ["constant_rewards", "exact"] and rewards.weights.tolist() == [1.0, 2.0]
    assert table[0].tolist() == [2.0, 1.0] and math.isnan(table[1, 0]) and table[1, 1] == 0.0


@pytest.mark.parametrize("name,message", [("wrong_length", "returned list of length 1 for 2 completions"),
                                          ("not_a_number", "returned 'yes' for completion 0")])
def test_reward_errors_name_the_function(name, message):
    rewards = RewardFunctions(RewardsConfig(functions=[RewardFunction(path=f"{HERE}.{name}")]))
    with pytest.raises(RewardError, match=message):
        rewards(prompts=["a", "b"], completions=["x", "y"], columns=[{}, {}], completion_ids=[[1], [2]])


def scored_group(group_id: int, table: list[list[float]], texts: list[str]):
    from driver.data.prompts import Prompt
    from driver.data.records import Group

    prompt = Prompt(index=group_id, text=f"prompt {group_id}", token_ids=[1, 2], columns={"answer": str(group_id)})
    return Group(group_id=group_id, prompt=prompt, samples=[], rewards=torch.tensor(table), texts=texts)


def test_warn_unscorable_names_the_first_completion_once(caplog):
    """TRL warns (logger.warning, "All reward functions returned None for the following kwargs") with the
    first such row's prompt, completion and columns; once for the step, however many rows."""
    from driver.rewards.functions import warn_unscorable

    nan = math.nan
    groups = [scored_group(0, [[1.0, nan], [nan, 0.5]], ["a", "b"]),
              scored_group(1, [[nan, nan], [0.0, nan], [nan, nan]], ["c", "d", "e"]),
              scored_group(2, [[nan, nan]], ["f"])]
    with caplog.at_level("WARNING", logger="driver.rewards.functions"):
        assert warn_unscorable(groups) == 3
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "All reward functions returned None" in message
    assert "'prompt': 'prompt 1'" in message and "'completion': 'c'" in message and "'answer': '1'" in message
    caplog.clear()
    with caplog.at_level("WARNING", logger="driver.rewards.functions"):
        assert warn_unscorable(groups[:1]) == 0
    assert not caplog.records
