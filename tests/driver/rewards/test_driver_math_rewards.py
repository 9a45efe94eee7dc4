"""driver.rewards.builtin's math rewards (accuracy_reward, reasoning_accuracy_reward, get_cosine_scaled_reward)
against TRL's own (trl.rewards of trl 1.16.0, in the test extra) on the same solutions and completions,
ours on text and on chat completions, TRL's on chat (it reads `completion[0]["content"]`); against
values checked by hand (TRL's docstring examples, the cosine schedule at its ends); in a thread, where
math-verify cannot set its alarm, and in a spawned reward worker, where it can; and their errors."""

import math
import pickle
import sys
import threading

import pytest

from driver.config import Config, RewardFunction, RewardsConfig
from driver.rewards import builtin
from driver.rewards.builtin import (accuracy_reward, get_cosine_scaled_reward, get_reasoning_accuracy_reward,
                                     reasoning_accuracy_reward)
from driver.rewards.functions import RewardError, RewardFunctions
from tests.trl_oracle import import_trl

TRL_REWARDS = import_trl("trl.rewards")
trl_accuracy_reward = TRL_REWARDS.accuracy_reward
trl_get_cosine_scaled_reward = TRL_REWARDS.get_cosine_scaled_reward
trl_reasoning_accuracy_reward = TRL_REWARDS.reasoning_accuracy_reward

# (solution, completion): equal forms, boxed answers before others, anchors, units, equations, several
# answers, text that does not parse, and solutions math-verify cannot parse (not scored: None).
CASES = [
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{3}}"),
    (r"\frac{1}{3}", r"My answer is \boxed{\frac{1}{2}}"),
    ("0.5", r"so \boxed{\frac{2}{4}}"),
    ("$0.5$", r"The final answer is $\frac{1}{2}$."),
    ("42", "The final answer is 42"),
    ("42", "The final answer is $42$"),
    ("42", "$42$"),
    ("42", "42"),
    ("7", r"I think $7$, but the final answer is $8$"),
    ("8", r"First $7$; then \boxed{8}"),
    ("8", r"\boxed{8}. The final answer is $7$."),  # a boxed answer first, wherever it is
    ("7", r"\boxed{8}. The final answer is $7$."),
    ("3", r"\boxed{3} then \boxed{4}"),
    ("10", r"\boxed{10\text{ cm}}"),
    ("10", r"\boxed{10 \, \mathrm{cm}}"),
    ("3", r"\boxed{x=3}"),
    ("3", r"\boxed{3.001}"),
    ("$x^2 + 2x + 1$", r"Expanding, the answer is \boxed{(x+1)^2}"),
    (r"$\{1, 2\}$", r"\boxed{\{2, 1\}}"),
    (r"$[1, 2)$", r"The final answer is $[1, 2)$"),
    ("-5", r"\boxed{-5}"),
    ("1000", r"\boxed{1,000}"),
    ("no number here", r"\boxed{3}"),
    ("", r"\boxed{3}"),
    ("3", ""),
    ("3", r"\boxed{"),
]
REASONING_CASES = [
    (r"\frac{1}{3}", r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{3}}"),
    (r"\frac{1}{3}", r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}"),
    (r"\frac{1}{3}", r"<think> Reasoning content with partial answers \boxed{\frac{1}{3}} but no final answer"),
    ("4", r"<think> maybe \boxed{4} </think> so \boxed{5}"),
    ("5", r"<think> maybe \boxed{4} </think> so \boxed{5}"),
    ("5", r"<think> a </think> b </think> \boxed{5}"),
    ("5", r"\boxed{5} </think> then \boxed{6}"),
    ("no number here", r"<think> a </think> \boxed{5}"),
    ("no number here", r"<think> a \boxed{5}"),
]


def chat(texts: list[str]) -> list[list[dict]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def columns(cases):
    solutions, texts = zip(*cases)
    return list(solutions), list(texts)


@pytest.mark.parametrize("ours,trl,cases", [
    (accuracy_reward, trl_accuracy_reward, CASES),
    (reasoning_accuracy_reward, trl_reasoning_accuracy_reward, REASONING_CASES),
    (accuracy_reward, trl_accuracy_reward, REASONING_CASES),
], ids=["accuracy", "reasoning_accuracy", "accuracy_on_reasoning"])
def test_equals_trl_on_text_and_chat_completions(ours, trl, cases):
    solutions, texts = columns(cases)
    expected = trl(chat(texts), solutions)
    assert 0.0 in expected and 1.0 in expected and None in expected  # every outcome is compared
    assert ours(texts, solution=solutions) == expected
    assert ours(chat(texts), solution=solutions, prompts=["q"] * len(texts), completion_ids=[[1]] * len(texts)) \
        == expected


def test_trls_docstring_examples():
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]
    assert accuracy_reward([r"My answer is \boxed{\frac{1}{3}}", r"My answer is \boxed{\frac{1}{2}}"],
                           solution=solutions) == [1.0, 0.0]
    assert get_cosine_scaled_reward(max_len=100)([r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}"],
                                                 [[1] * 50, [1] * 50], solution=solutions) == [0.75, -0.75]
    solutions, texts = columns(REASONING_CASES[:3])
    assert reasoning_accuracy_reward(texts, solution=solutions) == [1.0, 0.0, 0.0]


def test_a_number_as_solution_is_its_text():
    """A dataset column of numbers (GSM8K-like data read from JSON) scores as their text would."""
    assert accuracy_reward([r"\boxed{12}", r"\boxed{13}", r"\boxed{0.25}"], solution=[12, 12, 0.25]) == [1.0, 0.0, 1.0]


# (max_len, values): TRL's defaults, odd bounds, a one-token schedule, correct and wrong at the same value.
COSINE_SETTINGS = [
    (100, {}),
    (37, {"min_value_wrong": -2.0, "max_value_wrong": 0.0, "min_value_correct": 0.1, "max_value_correct": 3.0}),
    (1, {}),
    (8, {"min_value_wrong": 0.5, "max_value_wrong": 0.5, "min_value_correct": 0.5, "max_value_correct": 0.5}),
]


@pytest.mark.parametrize("max_len,values", COSINE_SETTINGS, ids=str)
def test_cosine_equals_trl_at_every_length(max_len, values):
    lengths = list(range(0, 2 * max_len + 3))  # every length, past max_len too (the schedule stays at its end)
    cases = [CASES[0], CASES[1], CASES[-3]]  # correct, wrong, a solution that does not parse
    solutions, texts = columns([case for case in cases for _ in lengths])
    ids = [[9] * length for _ in cases for length in lengths]
    expected = trl_get_cosine_scaled_reward(max_len, **values)(chat(texts), solutions, ids)
    ours = get_cosine_scaled_reward(max_len, **values)(texts, ids, solution=solutions)
    assert ours == pytest.approx(expected, abs=1e-12)
    assert ours[-1] is None and expected[-1] is None


def test_cosine_at_the_ends_of_its_schedule():
    """Correct: max_value_correct at length 0, their mean halfway, min_value_correct at max_len and beyond;
    wrong: min_value_wrong at length 0 (a short wrong answer costs most), max_value_wrong at max_len."""
    reward = get_cosine_scaled_reward(10, min_value_wrong=-1.0, max_value_wrong=-0.5, min_value_correct=0.5,
                                      max_value_correct=1.0)
    lengths = [0, 5, 10, 11, 25]
    texts = [r"\boxed{1}"] * 5 + [r"\boxed{2}"] * 5
    ids = [[3] * n for n in lengths] * 2
    assert reward(texts, ids, solution=["1"] * 10) == pytest.approx(
        [1.0, 0.75, 0.5, 0.5, 0.5, -1.0, -0.75, -0.5, -0.5, -0.5], abs=1e-12)


def test_cosine_reward_is_named_as_trl_and_pickles():
    reward = get_cosine_scaled_reward(100)
    assert reward.__name__ == trl_get_cosine_scaled_reward(100).__name__ == "cosine_scaled_reward"
    copy = pickle.loads(pickle.dumps(reward))
    assert copy([r"\boxed{1}"], [[1] * 100], solution=["1"]) == [0.5]


@pytest.mark.parametrize("arguments,message", [
    ({"max_len": 0}, "max_len must be a positive number of tokens, got 0"),
    ({"max_len": 10.0}, "max_len must be a positive number of tokens, got 10.0"),
    ({"max_len": True}, "max_len must be a positive number of tokens, got True"),
    ({"max_len": 10, "min_value_wrong": math.nan}, "min_value_wrong must be a finite number, got nan"),
    ({"max_len": 10, "max_value_correct": "1"}, "max_value_correct must be a finite number, got '1'"),
])
def test_bad_cosine_settings_name_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        get_cosine_scaled_reward(**arguments)


# Completions for other delimiters: each alone, both (the first listed that a completion holds splits it,
# wherever the other one is), neither, the first closing twice, and an answer only before the delimiter.
DELIMITED_CASES = [
    ("5", r"<reasoning> maybe \boxed{4} </reasoning> so \boxed{5}"),
    ("4", r"<reasoning> maybe \boxed{4} </reasoning> so \boxed{5}"),
    ("5", r"<think> \boxed{4} </think> \boxed{5}"),
    ("5", r"a </think> \boxed{4} </reasoning> \boxed{5}"),
    ("4", r"a </reasoning> \boxed{4} </think> b"),
    ("4", r"\boxed{4} </think> b </reasoning> c"),
    ("5", r"<reasoning> \boxed{5} with no end"),
    ("5", r"a </reasoning> b </reasoning> \boxed{5}"),
    ("no number here", r"a </reasoning> </think> \boxed{5}"),
]


@pytest.mark.parametrize("delimiters", [["</reasoning>"], ["</reasoning>", "</think>"], ["</think>", "</reasoning>"],
                                        ("</think>",)])
def test_other_reasoning_delimiters_score_as_trls(delimiters):
    """TRL's reasoning_delimiters, given to the function (as a TRL script's functools.partial does) and through
    the factory a config names; in either order of two, since the first listed that a completion holds wins."""
    solutions, texts = columns(DELIMITED_CASES)
    expected = trl_reasoning_accuracy_reward(chat(texts), solutions, reasoning_delimiters=list(delimiters))
    assert 0.0 in expected and 1.0 in expected and None in expected  # every outcome is compared
    assert reasoning_accuracy_reward(texts, solution=solutions, reasoning_delimiters=delimiters) == expected
    reward = pickle.loads(pickle.dumps(get_reasoning_accuracy_reward(reasoning_delimiters=delimiters)))
    assert reward(chat(texts), solution=solutions, prompts=["q"] * len(texts)) == expected
    assert reward.__name__ == "reasoning_accuracy_reward"


@pytest.mark.parametrize("delimiters,message", [
    ("</reasoning>", r"reasoning_delimiters must be a list of strings, e.g. \['</reasoning>'\], got '</reasoning>'"),
    ([], r"reasoning_delimiters must be one or more non-empty strings, got \[\]"),
    (["</think>", ""], r"reasoning_delimiters must be one or more non-empty strings, got \['</think>', ''\]"),
    ([1], r"reasoning_delimiters must be one or more non-empty strings, got \[1\]"),
    ({"end": "</think>"}, "reasoning_delimiters must be a list of strings, got dict"),
])
def test_bad_reasoning_delimiters_are_named(delimiters, message):
    """A string alone would be read character by character (TRL iterates it): every '<' would close the
    reasoning."""
    with pytest.raises(ValueError, match=message):
        get_reasoning_accuracy_reward(delimiters)
    with pytest.raises(ValueError, match=message):
        reasoning_accuracy_reward([r"\boxed{1}"], solution=["1"], reasoning_delimiters=delimiters)
    from driver.cli import ConfigError, reward_function

    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].path: driver.rewards.builtin."
                                          r"get_reasoning_accuracy_reward\(\*\*.*\) failed: " + message):
        reward_function("driver.rewards.builtin.get_reasoning_accuracy_reward",
                        {"reasoning_delimiters": delimiters}, "rewards.functions[0].path")


def test_in_a_thread_it_scores_without_math_verifys_alarm():
    """math-verify's timeouts use signal.alarm, which raises in any thread but the main one: there the
    rewards run without a limit (as TRL's), with the same values."""
    solutions, texts = columns(CASES)
    results, errors = [], []

    def score():
        try:
            results.append(accuracy_reward(texts, solution=solutions))
        except Exception as error:  # noqa: BLE001 - reported by the assert below
            errors.append(error)

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=120)
    assert not errors and results == [trl_accuracy_reward(chat(texts), solutions)]


def group_of(texts: list[str], columns: dict) -> tuple[list, list, list[dict], list[list[int]]]:
    return ["q"] * len(texts), texts, [columns] * len(texts), [[1, 2]] * len(texts)


def test_named_in_the_config_they_read_the_solution_column():
    functions = RewardFunctions(RewardsConfig(functions=[
        RewardFunction(path="driver.rewards.builtin.accuracy_reward"),
        RewardFunction(path="driver.rewards.builtin.reasoning_accuracy_reward"),
        RewardFunction(path="driver.rewards.builtin.get_cosine_scaled_reward", kwargs={"max_len": 4}),
        RewardFunction(path="driver.rewards.builtin.get_reasoning_accuracy_reward",
                       kwargs={"reasoning_delimiters": ["</answer>"]})]))
    assert functions.names == ["accuracy_reward", "reasoning_accuracy_reward", "cosine_scaled_reward",
                               "reasoning_accuracy_reward"]
    table = functions(*group_of([r"<think>x</think>\boxed{2}", r"\boxed{3}"], {"solution": "2", "id": 7}))
    assert table.tolist() == [[1.0, 1.0, pytest.approx(0.5 + 0.5 * (1 + math.cos(math.pi / 2)) / 2), 0.0],
                              [0.0, 0.0, pytest.approx(-1.0 + 0.5 * (1 + math.cos(math.pi / 2)) / 2), 0.0]]
    with pytest.raises(RewardError, match=r"(?s)reward 'accuracy_reward' raised .*accuracy_reward needs a "
                                          r"`solution` column \(each prompt's reference answer, as in TRL\): the "
                                          r"data's columns are answer, id$"):
        functions(*group_of([r"\boxed{2}"], {"answer": "2", "id": 3}))


def test_in_a_spawned_reward_worker_with_math_verifys_limits():
    """A reward worker calls in its main thread: math-verify's alarms are set (and cleared) there."""
    from driver.rewards.pool import RewardPool

    config = Config.model_validate({"rewards": {"functions": [{"path": "driver.rewards.builtin.accuracy_reward"}],
                                                "reward_num_workers": 1}})
    solutions, texts = columns(CASES)
    with RewardPool(config.rewards, num_workers=1, timeout=120.0) as pool:
        pool.submit(0, {"prompts": ["q"] * len(texts), "completions": texts, "completion_ids": [[1]] * len(texts),
                        "solution": solutions})
        (result,) = pool.wait([0]).values()
    assert result.failure is None
    expected = [math.nan if value is None else value for value in trl_accuracy_reward(chat(texts), solutions)]
    assert result.table[:, 0].tolist() == pytest.approx(expected, nan_ok=True)


def test_without_math_verify_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    builtin._math_verify.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"the math rewards need math-verify .*pip install math-verify==0\.9\.0, "
                                              r"or pykernels' `math` extra"):
            accuracy_reward([r"\boxed{1}"], solution=["1"])
    finally:
        builtin._math_verify.cache_clear()


def test_solutions_and_completions_must_pair_up():
    with pytest.raises(ValueError, match="reasoning_accuracy_reward: 1 solutions for 2 completions"):
        reasoning_accuracy_reward(["a", "b"], solution=["1"])
