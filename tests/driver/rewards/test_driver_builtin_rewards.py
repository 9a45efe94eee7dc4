"""driver.rewards.builtin's rewards that need no math-verify: DAPO's soft overlong punishment against its
formula (hand-computed values at the boundaries) and against TRL's get_soft_overlong_punishment (trl.rewards
of trl 1.16.0, in the test extra), counting the completion's tokens as the driver passes them to rewards;
the repetition penalty against TRL's and its formula; think_format_reward against TRL's and its
docstring's example; TRL's reward names in a config's errors. The math rewards:
test_driver_math_rewards.py."""

import pickle
import random
import sys

import pytest

from driver.config import RewardFunction, RewardsConfig
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample
from driver.rewards.builtin import get_repetition_penalty_reward, get_soft_overlong_punishment, think_format_reward
from driver.rewards.calling import call_rewards
from driver.rewards.functions import RewardFunctions, group_call, reward_table
from tests.trl_oracle import import_trl

TRL_REWARDS = import_trl("trl.rewards")
trl_get_repetition_penalty_reward = TRL_REWARDS.get_repetition_penalty_reward
trl_get_soft_overlong_punishment = TRL_REWARDS.get_soft_overlong_punishment
trl_think_format_reward = TRL_REWARDS.think_format_reward

FACTORY = "driver.rewards.builtin.get_soft_overlong_punishment"
SETTINGS_8_4 = {"max_completion_len": 8, "soft_punish_cache": 4}

# (L_max, L_cache): odd sizes, no cache, the whole length as cache, a one-token completion limit.
SETTINGS = [(100, 20), (7, 3), (83, 1), (16, 0), (5, 5), (1, 1), (769, 257)]


def completions_of(lengths: list[int]) -> list[list[int]]:
    return [[7] * length for length in lengths]


@pytest.mark.parametrize("settings,lengths,expected", [
    # L_max 100, L_cache 20: free up to 80, then -1/20 per token, -1 at 100 and beyond.
    ((100, 20), [0, 50, 79, 80, 81, 90, 99, 100, 101, 150], [0, 0, 0, 0, -0.05, -0.5, -0.95, -1, -1, -1]),
    # No cache: nothing until L_max, -1 past it.
    ((16, 0), [0, 15, 16, 17], [0, 0, 0, -1]),
    # The whole length as cache: every token costs 1 / L_max.
    ((5, 5), [0, 1, 2, 4, 5, 6], [0, -0.2, -0.4, -0.8, -1, -1]),
    ((7, 3), [4, 5, 6, 7, 8], [0, -1 / 3, -2 / 3, -1, -1]),
])
def test_the_formula_at_its_boundaries(settings, lengths, expected):
    reward = get_soft_overlong_punishment(*settings)
    assert reward(completion_ids=completions_of(lengths)) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_equals_trl_at_every_length(settings):
    lengths = list(range(settings[0] + 3))  # every length up to past L_max
    ours = get_soft_overlong_punishment(*settings)(completion_ids=completions_of(lengths))
    assert ours == trl_get_soft_overlong_punishment(*settings)(completions_of(lengths))  # the same arithmetic: exact


def test_named_as_trl_and_picklable():
    reward = get_soft_overlong_punishment(100, 20)
    assert reward.__name__ == "soft_overlong_punishment_reward"
    copy = pickle.loads(pickle.dumps(reward))
    assert copy(completion_ids=completions_of([90])) == [-0.5]


@pytest.mark.parametrize("settings,message", [
    ((0, 0), "max_completion_len must be a positive number of tokens, got 0"),
    ((10, -1), r"soft_punish_cache must be a number of tokens in \[0, max_completion_len = 10\], got -1"),
    ((10, 11), r"soft_punish_cache .* got 11"),
    ((10.5, 2), "max_completion_len must be .* got 10.5"),
])
def test_bad_settings_name_the_argument(settings, message):
    with pytest.raises(ValueError, match=message):
        get_soft_overlong_punishment(*settings)


def test_counts_tokens_through_the_configured_reward_call():
    """Named in rewards.functions and called with what the driver passes for a group (group_call): the
    sampled token ids decide, not the text's length (a 3-token completion of 40 characters is free)."""
    functions = RewardFunctions(RewardsConfig(functions=[RewardFunction(path=FACTORY, kwargs=SETTINGS_8_4)]))
    assert functions.names == ["soft_overlong_punishment_reward"]
    lengths = [3, 4, 5, 6, 8, 8]
    samples = [Sample(token_ids=list(range(n)), logprobs=[-1.0] * n, finish_reason="stop") for n in lengths]
    prompt = Prompt(index=0, text="Write digits:", token_ids=[1, 2], columns={"id": 0})
    group = Group(group_id=0, prompt=prompt, samples=samples)
    texts = ["x" * 40, "1234", "", "a b c", "12345678", "z"]
    kwargs = group_call(group, texts)
    table = reward_table(functions.names, call_rewards(functions.functions, kwargs), kwargs["completions"])
    assert table[:, 0].tolist() == pytest.approx([0, 0, -0.25, -0.5, -1, -1])


def test_the_yaml_entry_makes_it_in_reward_workers_too(tmp_path):
    """rewards.functions[].kwargs: the factory is called in every process that scores (here a spawned
    reward worker), and its arguments are checked before the run starts."""
    from driver.cli import ConfigError, check_references
    from driver.config import Config
    from driver.rewards.pool import RewardPool

    rewards = {"functions": [{"path": FACTORY, "kwargs": SETTINGS_8_4}], "reward_num_workers": 1}
    pool = RewardPool(Config.model_validate({"rewards": rewards}).rewards, num_workers=1, timeout=60.0)
    try:
        pool.submit(0, {"prompts": ["p"] * 3, "completions": ["a", "b", "c"],
                        "completion_ids": completions_of([4, 6, 9])})
        (result,) = pool.wait([0]).values()
    finally:
        pool.close()
    assert result.failure is None and result.table[:, 0].tolist() == [0.0, -0.5, -1.0]
    bad = Config.model_validate({"rewards": {"functions": [{"path": FACTORY, "kwargs": {"max_completion_len": 8}}]}})
    with pytest.raises(ConfigError, match="soft_punish_cache"):
        check_references(bad)
    with pytest.raises(ValueError, match="a reward model takes none"):
        RewardFunction(model="org/reward", kwargs={"x": 1})


THINK_TEXTS = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # TRL's docstring: 1.0
    "<think>\nThis is my reasoning.\nThis is my answer.",  # and 0.0
    "<think></think>", "<think>a</think>", "<think>a</think><think>b</think>", "<think><think>a</think>",
    "<think>a</think>\n<think>", " <think>a</think>", "answer first\n<think>a</think>", "</think>", "",
    "<think>\n\nmulti\nline\n\n</think>\n\n\\boxed{4}", "<THINK>a</THINK>", "<think>a</think >",
    "<think>a\n</think>tail\n</think>",
]


def test_think_format_equals_trl_on_text_and_chat_completions():
    expected = trl_think_format_reward([[{"role": "assistant", "content": text}] for text in THINK_TEXTS])
    assert expected[:2] == [1.0, 0.0] and sum(expected) == 5  # the oracle itself: its docstring, then ours' cases
    assert think_format_reward(THINK_TEXTS) == expected
    assert think_format_reward([[{"role": "assistant", "content": text}] for text in THINK_TEXTS]) == expected


def test_think_format_through_the_configured_reward_call():
    path = "driver.rewards.builtin.think_format_reward"
    functions = RewardFunctions(RewardsConfig(functions=[RewardFunction(path=path)]))
    assert functions.names == ["think_format_reward"]  # TRL's name in the logs
    samples = [Sample(token_ids=[5, 6], logprobs=[-1.0, -1.0], finish_reason="stop") for _ in range(3)]
    group = Group(group_id=0, prompt=Prompt(index=0, text="q", token_ids=[1], columns={}), samples=samples)
    kwargs = group_call(group, ["<think>a</think>b", "b", "<think>a"])
    table = reward_table(functions.names, call_rewards(functions.functions, kwargs), kwargs["completions"])
    assert table[:, 0].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("path,message", [
    ("think_format_reward", r"'think_format_reward' must be a dotted path like package.module.function \(TRL's "
                            r"think_format_reward is driver.rewards.builtin.think_format_reward\)"),
    ("get_soft_overlong_punishment", r"TRL's get_soft_overlong_punishment is driver.rewards.builtin."
                                     r"get_soft_overlong_punishment \(with its kwargs\)"),
    ("accuracy_reward", r"TRL's accuracy_reward is driver.rewards.builtin.accuracy_reward\)$"),
    ("trl.rewards.think_format_reward", r"cannot import module 'trl.rewards' .*\(TRL's think_format_reward is "
                                        r"driver.rewards.builtin.think_format_reward\)"),
    ("trl.rewards.get_cosine_scaled_reward", r"cannot import module 'trl.rewards' .*TRL's get_cosine_scaled_reward "
                                             r"is driver.rewards.builtin.get_cosine_scaled_reward \(with its kwargs\)"),
    ("my_reward", r"'my_reward' must be a dotted path like package.module.function$"),
])
def test_trl_reward_names_say_where_they_are_here(monkeypatch, path, message):
    from driver.cli import ConfigError, check_references
    from driver.config import Config

    for module in ("trl", "trl.rewards"):  # as without trl installed (the driver does not need it)
        monkeypatch.setitem(sys.modules, module, None)
    config = Config.model_validate({"rewards": {"functions": [{"path": path}]}})
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].path: .*" + message):
        check_references(config)


def test_every_trl_reward_is_built_in():
    """Each reward trl.rewards exports has ours of the same name at the path the config error gives."""
    from driver.cli import TRL_REWARDS as OURS
    from driver.cli import import_dotted

    theirs = {name for name in dir(TRL_REWARDS) if not name.startswith("_") and callable(getattr(TRL_REWARDS, name))}
    assert theirs == set(OURS)
    for name, where in OURS.items():
        assert where.split()[0] == f"driver.rewards.builtin.{name}"
        import_dotted(where.split()[0], "test")


# Completions of random tokens from small vocabularies (repeats likely), lengths 0 to past every n-gram size.
RANDOM_IDS = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
              for rng in [random.Random(5)] for vocab in (1, 2, 3, 5, 50, 1000) for _ in range(12)]


@pytest.mark.parametrize("ngram_size,max_penalty", [(3, -1.0), (1, -1.0), (2, -0.5), (5, -2.0), (7, 0.0), (40, -1.0)])
def test_repetition_penalty_equals_trl(ngram_size, max_penalty):
    ours = get_repetition_penalty_reward(ngram_size, max_penalty)(completion_ids=RANDOM_IDS)
    assert ours == pytest.approx(trl_get_repetition_penalty_reward(ngram_size, max_penalty)(RANDOM_IDS), abs=1e-12)


def test_repetition_penalty_by_hand():
    """TRL's docstring example; one n-gram k times costs (1 - 1/k) of the penalty; none repeated, or too short:
    0; n-grams counted over tokens, overlapping."""
    reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert reward(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5]]) == [0.0, -0.75]
    reward = get_repetition_penalty_reward()  # TRL's defaults: trigrams, -1
    assert reward(completion_ids=[[], [1, 2], [1, 2, 3], [1, 2, 3, 1, 2, 3], [7, 8, 7, 8, 7, 8, 7]]) == pytest.approx(
        [0.0, 0.0, 0.0, -1 / 4, -3 / 5])
    assert reward.__name__ == "repetition_penalty_reward" == trl_get_repetition_penalty_reward().__name__
    assert pickle.loads(pickle.dumps(reward))(completion_ids=[[4] * 6]) == [-0.75]


@pytest.mark.parametrize("arguments,message", [
    ({"ngram_size": 0}, "ngram_size must be a positive number of tokens, got 0"),
    ({"ngram_size": 2.0}, "ngram_size must be a positive number of tokens, got 2.0"),
    ({"max_penalty": 0.5}, r"max_penalty must be a finite number <= 0 \(a penalty\), got 0.5"),
    ({"max_penalty": float("-inf")}, "max_penalty must be .* got -inf"),
    ({"max_penalty": float("nan")}, "max_penalty must be .* got nan"),
])
def test_bad_repetition_settings_name_the_argument(arguments, message):
    with pytest.raises(ValueError, match=message):
        get_repetition_penalty_reward(**arguments)
