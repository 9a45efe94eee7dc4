"""Which prompts train and which are evaluated (driver/data/eval_prompts.py): eval.val_set_size holds rows of
data.source out of training, the same ones for the same seed; eval.source reads another dataset with data's
columns and transform, its mistakes named by eval.source; and the eval section's own mistakes are named by key."""

import json

import pytest
from transformers import AutoTokenizer

from driver.cli import ConfigError, load_config
from driver.config import Config
from driver.data.eval_prompts import hold_out, training_and_eval_prompts
from driver.data.tiny_model import resolve_model_path
from driver.data.toy_tasks import toy_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))


def prompts_of(config: dict, tokenizer):
    """(training, the one evaluation set's prompts or None)."""
    training, sets = training_and_eval_prompts(Config.model_validate(config), tokenizer)
    return training, None if sets is None else sets[""]


def texts(source) -> list[str]:
    return [prompt.text for prompt in source.prompts]


@pytest.mark.parametrize("size, held", [(0.125, 32), (10, 10), (0.001, 0)])  # 0: refused below
def test_val_set_size_holds_a_seeded_part_of_the_data_out_of_training(tokenizer, size, held):
    config = {"eval": {"steps": 5, "val_set_size": size}}
    if not held:
        with pytest.raises(ConfigError, match=r"eval.val_set_size = 0.001 holds out 0 of the 256 prompts"):
            prompts_of(config, tokenizer)
        return
    training, evaluated = prompts_of(config, tokenizer)
    rows = toy_dataset("digits")
    assert len(evaluated.prompts) == held and len(training.prompts) == len(rows) - held
    # Between them every row once, each side in the data's order, the row indices kept.
    indices = sorted(p.index for p in training.prompts + evaluated.prompts)
    assert indices == list(range(len(rows)))
    for source in (training, evaluated):
        assert [p.index for p in source.prompts] == sorted(p.index for p in source.prompts)
        assert all(p.text == rows[p.index]["prompt"] for p in source.prompts)
    again = prompts_of(config, tokenizer)[1]
    other_seed = prompts_of({**config, "train": {"seed": 1}}, tokenizer)[1]
    assert texts(again) == texts(evaluated) and texts(other_seed) != texts(evaluated)


def test_the_held_out_rows_are_a_uniform_draw():
    rows = [{"n": n} for n in range(1000)]
    kept, held = hold_out(rows, 100, seed=0)
    assert len(held) == 100 and {n for n, _ in kept}.isdisjoint(n for n, _ in held)
    assert 300 < sum(n for n, _ in held) / 100 < 700  # not the first or last hundred


def test_without_evaluation_every_row_trains(tokenizer):
    training, evaluated = prompts_of({}, tokenizer)
    assert evaluated is None and len(training.prompts) == len(toy_dataset("digits"))


def test_an_eval_source_is_read_with_datas_columns_in_file_order(tokenizer, tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"question": f"Write digits: {word}", "answer": str(n)}) + "\n"
                            for n, word in enumerate(["river", "apple", "stone", "train"])))
    training, evaluated = prompts_of({"data": {"prompt_field": "question", "source": str(path)},
                                      "eval": {"steps": 2, "source": str(path), "max_prompts": 3}}, tokenizer)
    assert texts(evaluated) == ["Write digits: river", "Write digits: apple", "Write digits: stone"]
    assert evaluated.prompts[1].columns["answer"] == "1"
    assert not evaluated.config.shuffle and len(training.prompts) == 4  # a source of its own holds nothing out


def test_eval_source_mistakes_are_named_by_eval_source(tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"^eval.source: .*empty.jsonl is empty"):
        prompts_of({"eval": {"steps": 2, "source": str(empty)}}, tokenizer)
    config = tmp_path / "cfg.yaml"
    config.write_text("eval: {steps: 2, source: missing/file.jsonl}\n")
    with pytest.raises(ConfigError, match=r"eval.source: dataset file missing/file.jsonl does not exist"):
        load_config(config, {})


@pytest.mark.parametrize("section, message", [
    ({"steps": 5}, "exactly one of eval.source (a dataset, e.g. its test split), eval.sets (named datasets) and "
                   "eval.val_set_size"),
    ({"steps": 2, "source": "toy:digits", "sets": {"a": {"source": "toy:digits"}}}, "exactly one of eval.source"),
    ({"steps": 2, "sets": {"a/b": {"source": "toy:digits"}}}, "eval.sets: 'a/b' is no set name"),
    ({"steps": 2, "sets": {"a": {"source": "toy:digits"}}, "save_best": True},
     "eval.best_metric = reward: with eval.sets it names one of them, <set>/<metric> (e.g. a/reward)"),
    ({"on_start": True, "source": "toy:digits", "val_set_size": 8}, "exactly one of eval.source"),
    ({"split": "validation"}, "eval.split is set but eval.steps = 0 and eval.on_start and eval.only are false"),
    ({"steps": 5, "val_set_size": 2.5}, "eval.val_set_size = 2.5: a fraction below 1 or a whole count"),
    ({"steps": 3, "val_set_size": 8}, "eval.steps = 3 must be a multiple of rollout.vllm_sync_interval = 2"),
    ({"steps": 2, "val_set_size": 8, "temperature": 0, "num_generations": 4},
     "eval.temperature = 0 decodes greedily: eval.num_generations = 4 completions of a prompt would all be the same"),
])
def test_eval_section_mistakes_are_named_by_key(tmp_path, section, message):
    config = tmp_path / "cfg.yaml"
    config.write_text(json.dumps({"eval": section, "rollout": {"vllm_sync_interval": 2}}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(config, {})


def test_ebft_has_no_reward_functions_to_evaluate_with(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(json.dumps({"algo": {"name": "ebft"}, "data": {"source": "toy:digits-gt"},
                                  "ebft": {"ground_truth_field": "answer"}, "eval": {"steps": 2, "val_set_size": 8}}))
    with pytest.raises(ConfigError, match="eval with algo.name = ebft: evaluation scores with the reward functions"):
        load_config(config, {})


def test_a_runs_own_config_yaml_reads_back_without_evaluation(tmp_path):
    """config.yaml lists every key, defaults included: the check compares with the defaults."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(Config().model_dump(mode="json")))
    assert not load_config(config, {}).eval.enabled


def test_eval_sets_are_each_read_with_datas_columns_and_their_mistakes_named_by_set(tokenizer, tmp_path):
    """eval.sets (TRL's eval_dataset as a dict): a PromptSource per set, each its own source in file order;
    training keeps every row of data.source; best_metric <set>/<metric> is the key eval_<set>/<metric>."""
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(5)))
    config = Config.model_validate({"data": {"prompt_field": "question", "source": str(path)},
                                    "eval": {"steps": 2, "sets": {"file": {"source": str(path)},
                                                                  "again": {"source": str(path)}},
                                             "max_prompts": 3, "save_best": True, "best_metric": "again/reward"}})
    training, sets = training_and_eval_prompts(config, tokenizer)
    assert list(sets) == ["file", "again"] and len(training.prompts) == 5
    assert texts(sets["file"]) == texts(sets["again"]) == ["q0", "q1", "q2"]
    assert config.eval.best_key() == "eval_again/reward" and config.eval.labels() == ["file", "again"]
    bad = {"steps": 2, "sets": {"ok": {"source": str(path)}, "empty": {"source": str(tmp_path / "none.jsonl")}}}
    with pytest.raises(ConfigError, match=r"^eval.sets.empty.source: dataset file .*none.jsonl does not exist"):
        prompts_of({"data": {"prompt_field": "question", "source": str(path)}, "eval": bad}, tokenizer)
