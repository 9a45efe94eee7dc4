"""The reasoning-gym adapter (driver/data/reasoning_gym.py, driver/rewards/reasoning_gym.py) against
reasoning-gym itself: its create_dataset gives the entries the rows must hold, and its dataset's
score_answer on an answer is the value our reward must give a completion holding <answer>answer</answer>,
inline and in a reward worker process."""

import json
import sys

import pytest
import reasoning_gym
import torch

from driver.cli import ConfigError
from driver.config import DataConfig, RewardFunction, RewardsConfig
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample
from driver.data.sources import load_source_rows
from driver.rewards.functions import RewardFunctions, group_call
from driver.rewards.pool import RewardPool
from driver.rewards import reasoning_gym as reasoning_gym_reward
from driver.rewards.reasoning_gym import score

SIZE = 7
# basic_arithmetic: exact match; arc_agi: its boards are tuples in the entry's metadata (a JSON round
# trip would score the right answer 0.05); base_conversion: reasoning-gym's default partial credit.
TASKS = ("basic_arithmetic", "arc_agi", "base_conversion")
REWARDS = RewardsConfig(functions=[RewardFunction(path="driver.rewards.reasoning_gym.score")])


def rows(source: str) -> list[dict]:
    return load_source_rows(DataConfig(source=f"reasoning_gym:{source}"))


def oracle(task: str, seed: int = 0, **config):
    return reasoning_gym.create_dataset(task, size=SIZE, seed=seed, **config)


def scored(rows_: list[dict], completions: list) -> list[float | None]:
    return score(prompts=[row["prompt"] for row in rows_], completions=completions,
                 entry=[row["entry"] for row in rows_], task=[row["task"] for row in rows_])


def tagged(answer: str) -> str:
    return f"Let me think. <answer>{answer}</answer>"


@pytest.mark.parametrize("task", TASKS)
def test_rows_hold_reasoning_gyms_entries_as_chat_prompts(task):
    loaded, expected = rows(f"{task}?size={SIZE}"), list(oracle(task))  # seed 0 unless given
    assert [row["entry"] for row in loaded] == expected
    system = reasoning_gym.utils.SYSTEM_PROMPTS["default"]
    assert all(row["prompt"] == [{"role": "system", "content": system},
                                 {"role": "user", "content": row["entry"]["question"]}] for row in loaded)
    assert {row["task"] for row in loaded} == {f"{task}?seed=0&size={SIZE}"}
    json.dumps(loaded)  # JSON-able, as any column


def test_size_seed_and_config_fields_reach_create_dataset():
    loaded = rows(f"basic_arithmetic?seed=3&size={SIZE}&max_terms=2&max_digits=1&operators=[+, -]")
    assert [row["entry"] for row in loaded] == list(oracle("basic_arithmetic", seed=3, max_terms=2, max_digits=1,
                                                           operators=("+", "-")))
    assert loaded[0]["task"] == f"basic_arithmetic?max_digits=1&max_terms=2&operators=[+, -]&seed=3&size={SIZE}"
    assert [row["entry"] for row in rows(f"basic_arithmetic?size={SIZE}&seed=4")] != [row["entry"] for row in loaded]


@pytest.mark.parametrize("choice, system", [("direct", reasoning_gym.utils.SYSTEM_PROMPTS["direct"]),
                                            ("Reply%20in%20%3Canswer%3E%20tags%20%26%20nothing%20else.",
                                             "Reply in <answer> tags & nothing else."),
                                            ("", None)])
def test_the_system_prompt_is_named_written_or_left_out(choice, system):
    loaded = rows(f"basic_arithmetic?size=2&system_prompt={choice}")
    expected = [] if system is None else [{"role": "system", "content": system}]
    assert loaded[0]["prompt"] == [*expected, {"role": "user", "content": loaded[0]["entry"]["question"]}]
    assert loaded[0]["task"] == "basic_arithmetic?seed=0&size=2"  # not a field of the task's config


@pytest.mark.parametrize("task", TASKS)
def test_the_reward_is_the_tasks_own_score_of_the_tagged_answer(task):
    loaded, dataset = rows(f"{task}?size={SIZE}"), oracle(task)
    right = [entry["answer"] for entry in dataset]
    wrong = [answer + " and more" for answer in right]
    assert [dataset.score_answer(answer, entry) for answer, entry in zip(right, dataset)] == [1.0] * SIZE
    expected_wrong = [dataset.score_answer(answer, entry) for answer, entry in zip(wrong, dataset)]
    assert all(value < 1.0 for value in expected_wrong)
    assert scored(loaded, [tagged(answer) for answer in right]) == [1.0] * SIZE
    assert scored(loaded, [tagged(answer) for answer in wrong]) == expected_wrong
    # a conversation's last message is scored; the last tag counts; no tag is score_answer(None, entry)
    assert scored(loaded, [[{"role": "assistant", "content": tagged(answer)}] for answer in right]) == [1.0] * SIZE
    assert scored(loaded, [tagged(w) + tagged(r) for w, r in zip(wrong, right)]) == [1.0] * SIZE
    assert scored(loaded, right) == [dataset.score_answer(None, entry) for entry in dataset]


def test_rows_without_an_entry_get_none_and_data_without_the_columns_is_refused():
    loaded = rows("basic_arithmetic?size=2")
    assert score(prompts=["q", "q"], completions=[tagged(loaded[0]["entry"]["answer"])] * 2,
                 entry=[loaded[0]["entry"], None], task=[loaded[0]["task"], None]) == [1.0, None]
    with pytest.raises(ValueError, match=r"needs the columns `entry` and `task`.*\['answer'\]"):
        score(prompts=["q"], completions=["<answer>4</answer>"], answer=["4"])


def test_an_answer_the_verifier_cannot_read_scores_zero_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(reasoning_gym_reward, "_warned", set())
    loaded = rows("prime_factorization?size=2")  # its score_answer runs int() on the answer's factors
    with pytest.raises(ValueError):
        oracle("prime_factorization").score_answer("x", loaded[0]["entry"])
    with caplog.at_level("WARNING", logger="driver.rewards.reasoning_gym"):
        values = scored(loaded * 2, [tagged("x"), tagged("y"), tagged(loaded[0]["entry"]["answer"]), "none"])
    assert values == [0.0, 0.0, 1.0, 0.0]
    assert len([r for r in caplog.records if "prime_factorization verifier raised ValueError" in r.message]) == 1


def test_a_reward_worker_scores_as_the_trainer_and_as_reasoning_gym():
    """Through the worker pool: the columns are pickled to a spawned process that rebuilds the dataset
    from `task`; ARC's tuples survive, so its right answers still score 1."""
    calls, expected = [], []
    for group_id, task in enumerate(("basic_arithmetic", "arc_agi")):
        row, dataset = rows(f"{task}?size=1")[0], oracle(task)
        texts = [tagged(dataset[0]["answer"]), tagged("0"), "no tag"]
        prompt = Prompt(index=0, text="rendered", token_ids=[1, 2], columns=row, messages=row["prompt"])
        samples = [Sample(token_ids=[3], logprobs=[-1.0], finish_reason="stop") for _ in texts]
        calls.append((group_id, group_call(Group(group_id=group_id, prompt=prompt, samples=samples), texts), row))
        expected += [1.0, dataset.score_answer("0", dataset[0]), dataset.score_answer(None, dataset[0])]
    with RewardPool(REWARDS, num_workers=1, timeout=120.0) as pool:
        for group_id, call, _ in calls:
            pool.submit(group_id, call)
        results = pool.wait([group_id for group_id, _, _ in calls])
    assert [result.failure for result in results.values()] == [None, None]
    table = torch.cat([results[group_id].table for group_id, _, _ in calls])
    assert table[:, 0].tolist() == torch.tensor(expected).tolist()  # the table is float32
    trainer = RewardFunctions(REWARDS)
    inline = torch.cat([trainer(call["prompts"], call["completions"], [row] * 3, call["completion_ids"])
                        for _, call, row in calls])
    torch.testing.assert_close(table, inline, rtol=0, atol=0)


@pytest.mark.parametrize("source, message", [
    ("basic_arithmetc", r"unknown reasoning-gym task 'basic_arithmetc'; did you mean basic_arithmetic.*tasks, e\.g\. "
                        r"ab, acre"),
    ("basic_arithmetic?colour=red", r"unexpected keyword argument 'colour'.*fields of basic_arithmetic's config: "
                                    r"allow_negation"),
    ("basic_arithmetic?max_digits=0", r"max_digits must be >= min_digits"),
    ("basic_arithmetic?size", r"'size' is not key=value"),
    ("", r"needs a task, e\.g\. reasoning_gym:basic_arithmetic"),
])
def test_bad_sources_are_config_errors(source, message):
    with pytest.raises(ConfigError, match=message):
        rows(source)


def test_without_reasoning_gym_the_error_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    with pytest.raises(ConfigError, match=r"pip install reasoning-gym==\d"):
        rows("basic_arithmetic?size=1")
