"""data.source beyond local files: a dataset directory in a Hub repository's layout (configs named in its
README.md), a Hub dataset id (datasets.load_dataset is replaced here: no network), and axolotl's
transform signature, with the axolotl-style GSM8K recipe of examples/ run unchanged on a local copy."""

import json

import datasets
import pytest

from driver.cli import ConfigError, load_config
from driver.config import DataConfig
from driver.data.prompts import PromptSource, load_rows
from driver.data.records import Group, Sample
from driver.data.tiny_model import resolve_model_path
from driver.rewards.functions import RewardFunctions, group_call

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
# a GSM8K-shaped dataset repository
"""
ROWS = {"main/train": [{"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"},
                       {"question": "Half of 144?", "answer": "144 / 2 = 72\n#### 72"}],
        "main/test": [{"question": "10 x 10?", "answer": "#### 100"}],
        "socratic/train": [{"question": "How many? 3 + 4", "answer": "What is 3 + 4? 7\n#### 7"}]}


@pytest.fixture
def dataset_repo(tmp_path):
    repo = tmp_path / "gsm8k"
    for name, rows in ROWS.items():
        path = repo / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(row) for row in rows))
    (repo / "README.md").write_text(README)
    return repo


def test_a_dataset_directory_loads_by_config_and_split(dataset_repo):
    for name, split in (("main", "train"), ("main", "test"), ("socratic", "train")):
        rows = load_rows(DataConfig(source=str(dataset_repo), name=name, split=split, prompt_field="question"))
        assert rows == ROWS[f"{name}/{split}"]
    with pytest.raises(ConfigError, match=r"data.source .*gsm8k \(name main\), split validation: ValueError"):
        load_rows(DataConfig(source=str(dataset_repo), name="main", split="validation", prompt_field="question"))


def test_a_hub_id_goes_to_datasets_with_config_split_and_revision(monkeypatch):
    calls = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return [{"prompt": "hello"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    config = load_config(None, {"data.source": "openai/gsm8k", "data.name": "main", "data.split": "test",
                                "data.revision": "abc123"}).data
    assert load_rows(config) == [{"prompt": "hello"}]
    assert calls == [("openai/gsm8k", {"name": "main", "split": "test", "revision": "abc123"})]


def test_an_unreachable_hub_dataset_is_a_config_error_that_mentions_offline_mode(monkeypatch):
    def load_dataset(path, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"openai/gsm8k.*split train: ConnectionError.*offline: only datasets "
                                          r"already in the cache load"):
        load_rows(DataConfig(source="openai/gsm8k"))


@pytest.mark.parametrize("source,message", [("no/such/path", "is not a toy set, an existing dataset file or"),
                                            ("missing.parquet", "dataset file missing.parquet does not exist")])
def test_sources_that_are_nothing_are_config_errors(source, message):
    with pytest.raises(ConfigError, match=f"data.source: .*{message}"):
        load_config(None, {"data.source": source})


@pytest.mark.parametrize("name, text, message", [
    ("empty.jsonl", "", r"data.source: .*empty.jsonl is empty"),
    ("blank.jsonl", "\n\n", r"blank.jsonl could not be read as json: ValueError: .*no data"),
    ("torn.jsonl", '{"prompt": "a"}\n{"prompt": \n', r"torn.jsonl could not be read as json: ArrowInvalid: JSON parse"),
    ("bad.parquet", "not parquet", r"bad.parquet could not be read as parquet: "),
])
def test_a_data_file_that_cannot_be_read_is_a_config_error_with_the_parsers_words(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_rows(DataConfig(source=str(tmp_path / name)))


def test_the_axolotl_gsm8k_recipe_runs_unchanged(dataset_repo):
    """axolotl's transform signature (cfg -> (map_fn, remove_columns)) and its message-list rewards."""
    from transformers import AutoTokenizer

    config = DataConfig(source=str(dataset_repo), name="main",
                        transform="examples.recipes.axolotl_gsm8k.prompt_transform", shuffle=False)
    rows = load_rows(config)
    assert [row["answer"] for row in rows] == ["4", "72"] and "question" not in rows[0]
    assert rows[1]["prompt"][-1] == {"role": "user", "content": "Half of 144?"}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))
    prompt = PromptSource(config, tokenizer, seed=0).prompts[1]
    assert prompt.messages == rows[1]["prompt"]
    texts = ["<think>144 / 2</think> <answer>72</answer>", "<answer>71</answer>", "72"]
    group = Group(1, prompt, [Sample([1], [-1.0], "stop") for _ in texts])
    rewards = RewardFunctions(load_config(None, {"rewards.functions": (
        "[{path: examples.recipes.axolotl_gsm8k.accuracy_reward}, "
        "{path: examples.recipes.axolotl_gsm8k.format_reward}]")}).rewards)
    kwargs = group_call(group, texts)
    table = rewards(kwargs["prompts"], kwargs["completions"], [prompt.columns] * 3, kwargs["completion_ids"])
    assert table.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]


def not_an_axolotl_transform(cfg):
    return {"prompt": "x"}


def test_a_cfg_factory_that_returns_no_map_fn_is_a_config_error():
    with pytest.raises(ConfigError, match=r"looks like an axolotl transform .* returned dict, not \(map_fn"):
        load_rows(DataConfig(transform=f"{__name__}.not_an_axolotl_transform"))
