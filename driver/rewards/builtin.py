"""Reward functions that come with the driver and fit any task (the task-specific ones live with their
data: driver/data/toy_tasks.py, driver/data/gsm8k.py). Each is TRL's reward of the same name, with
TRL's values and its name in the logs (`rewards/<name>/*` match a TRL run's): a function
(`{path: driver.rewards.builtin.think_format_reward}`), or a factory `get_<name>(settings) -> reward`
named with its arguments in `kwargs` (docs/rewards.md), whose reward is a picklable callable (reward
workers may receive it by pickle, as TRL's async workers do):
`{path: driver.rewards.builtin.get_soft_overlong_punishment, kwargs: {max_completion_len: 256, soft_punish_cache: 64}}`.

Standard library only at import: a reward worker that imports it loads no torch. The math rewards
(accuracy_reward, reasoning_accuracy_reward and its get_reasoning_accuracy_reward, get_cosine_scaled_reward)
import math-verify on their first call (the `math` extra: `pip install math-verify==0.9.0`).
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading

from driver.data.conversation import completion_text

# TRL's pattern: the completion opens with <think>, closes it once, and holds no second <think>.
_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **columns) -> list[float]:
    """1.0 where the completion's reasoning is enclosed in one leading `<think>...</think>`, else 0.0
    (TRL's trl.rewards.think_format_reward). A completion is its text, or for chat data the one
    assistant message the driver passes (TRL reads its first message, we its last: the same one).
    A chat template that opens the think block in the prompt (DeepSeek-R1's) leaves `<think>` out of
    every completion: each scores 0, as in TRL."""
    return [1.0 if _THINK_FORMAT.match(completion_text(completion)) else 0.0 for completion in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13; TRL's trl.rewards function of this
    name). For a completion of L tokens, L_max = max_completion_len, L_cache = soft_punish_cache:

        0                               if L <= L_max - L_cache
        (L_max - L_cache - L) / L_cache if L_max - L_cache < L <= L_max   (0 down to -1)
        -1                              if L > L_max

    L counts completion tokens (`completion_ids`, what the engine sampled: a final end-of-sequence token
    included when it stopped on one), never characters. With L_max = rollout.sampling.max_tokens no
    completion exceeds L_max, so only the linear ramp applies; L_cache = 0 punishes nothing up to L_max.
    """
    if not isinstance(max_completion_len, int) or max_completion_len < 1:
        raise ValueError(f"max_completion_len must be a positive number of tokens, got {max_completion_len!r}")
    if not isinstance(soft_punish_cache, int) or not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache must be a number of tokens in [0, max_completion_len = "
                         f"{max_completion_len}], got {soft_punish_cache!r}")
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class SoftOverlongPunishment:
    """The reward get_soft_overlong_punishment returns: a class, not a closure, so that it pickles."""

    __name__ = "soft_overlong_punishment_reward"  # TRL's: the reward's name in the logs

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **columns) -> list[float]:
        """One penalty in [-1, 0] per completion; prompts, completions and dataset columns are ignored."""
        free = self.max_completion_len - self.soft_punish_cache  # tokens allowed before any punishment
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_len:  # free < length: soft_punish_cache > 0 here
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """A penalty for repeating oneself (arXiv 2502.03373, App. C.2; TRL's trl.rewards function of this
    name): max_penalty times the fraction of a completion's token n-grams that repeat an earlier one,

        (1 - distinct n-grams / n-grams) * max_penalty

    0 for a completion without a repeated n-gram (or shorter than ngram_size tokens), max_penalty * (1 -
    1/k) for one n-gram k times over. N-grams of `completion_ids`, the sampled tokens: whatever the
    language, and a degenerate loop is caught however the tokenizer spells it."""
    if isinstance(ngram_size, bool) or not isinstance(ngram_size, int) or ngram_size < 1:
        raise ValueError(f"ngram_size must be a positive number of tokens, got {ngram_size!r}")
    if isinstance(max_penalty, bool) or not isinstance(max_penalty, (int, float)) or not -math.inf < max_penalty <= 0:
        raise ValueError(f"max_penalty must be a finite number <= 0 (a penalty), got {max_penalty!r}")
    return RepetitionPenalty(ngram_size, float(max_penalty))


class RepetitionPenalty:
    """The reward get_repetition_penalty_reward returns: a class, not a closure, so that it pickles."""

    __name__ = "repetition_penalty_reward"  # TRL's: the reward's name in the logs

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **columns) -> list[float]:
        """One penalty in [max_penalty, 0] per completion; prompts, completions and dataset columns are ignored."""
        rewards = []
        for ids in completion_ids:
            count = len(ids) - self.ngram_size + 1
            if count < 1:
                rewards.append(0.0)
                continue
            distinct = len({tuple(ids[start:start + self.ngram_size]) for start in range(count)})
            rewards.append((1.0 - distinct / count) * self.max_penalty if distinct < count else 0.0)
        return rewards


# TRL's math-verify limits (seconds): the gold solution's and the completion's parse, then their comparison.
PARSE_TIMEOUT_S = 10
VERIFY_TIMEOUT_S = 5


def accuracy_reward(completions: list, solution: list | None = None, **columns) -> list[float | None]:
    """1.0 where the completion's answer is mathematically equal to the `solution` column's, else 0.0;
    None (not scored) where math-verify cannot parse the solution. TRL's trl.rewards.accuracy_reward:
    the answer is LaTeX, a \\boxed{} one before any other, else one in $...$ after "the final answer is";
    a bare 42 in the prose, or $42$ without that phrase, is none (0.0), and so are two boxed answers.
    Units are normalised away; equality is math-verify's (0.5 = \\frac{2}{4}, (x+1)^2 = x^2+2x+1, sets,
    intervals)."""
    return [None if gold is None else _answer_is(gold, text) for gold, text in _gold_and_texts(
        "accuracy_reward", completions, solution, columns)]


_REASONING_DELIMITERS = ("</think>",)  # TRL's default


def reasoning_accuracy_reward(completions: list, solution: list | None = None,
                              reasoning_delimiters: list[str] | None = None, **columns) -> list[float | None]:
    """accuracy_reward on what follows the completion's reasoning; 0.0 for a completion that never
    closes it (TRL's trl.rewards.reasoning_accuracy_reward: an answer inside the reasoning earns nothing).
    `reasoning_delimiters`, TRL's argument, are the strings that close the reasoning (default
    `["</think>"]`), tried in their order: the first a completion holds splits it, and the answer is the
    text after its last occurrence. From a config, get_reasoning_accuracy_reward passes them."""
    delimiters = _reasoning_delimiters(reasoning_delimiters)
    rewards = []
    for gold, text in _gold_and_texts("reasoning_accuracy_reward", completions, solution, columns):
        delimiter = next((d for d in delimiters if d in text), None)
        if delimiter is None:
            rewards.append(0.0)
        else:
            rewards.append(None if gold is None else _answer_is(gold, text.split(delimiter)[-1]))
    return rewards


def get_reasoning_accuracy_reward(reasoning_delimiters: list[str]) -> ReasoningAccuracyReward:
    """reasoning_accuracy_reward with other strings closing the reasoning, for a config (a TRL script passes
    them with functools.partial): `{path: driver.rewards.builtin.get_reasoning_accuracy_reward, kwargs:
    {reasoning_delimiters: ["</reasoning>", "</think>"]}}`. Same values, same name in the logs."""
    return ReasoningAccuracyReward(_reasoning_delimiters(reasoning_delimiters))


class ReasoningAccuracyReward:
    """The reward get_reasoning_accuracy_reward returns: a class, not a closure, so that it pickles."""

    __name__ = "reasoning_accuracy_reward"  # TRL's: the reward's name in the logs

    def __init__(self, delimiters: tuple[str, ...]) -> None:
        self.delimiters = delimiters

    def __call__(self, completions: list, solution: list | None = None, **columns) -> list[float | None]:
        return reasoning_accuracy_reward(completions, solution, list(self.delimiters), **columns)


def _reasoning_delimiters(value: list[str] | None) -> tuple[str, ...]:
    """TRL's reasoning_delimiters checked: a string alone would be taken character by character there."""
    if value is None:
        return _REASONING_DELIMITERS
    if isinstance(value, str):
        raise ValueError(f"reasoning_delimiters must be a list of strings, e.g. [{value!r}], got {value!r}")
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"reasoning_delimiters must be a list of strings, got {type(value).__name__}")
    if not value or not all(isinstance(d, str) and d for d in value):
        raise ValueError(f"reasoning_delimiters must be one or more non-empty strings, got {value!r}")
    return tuple(value)


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaledReward:
    """accuracy_reward scaled by the completion's length in tokens on a cosine schedule (arXiv 2502.03373,
    App. C.1; TRL's trl.rewards.get_cosine_scaled_reward). With p = min(L / max_len, 1) for a completion
    of L tokens (`completion_ids`):

        correct: min_value_correct + (max_value_correct - min_value_correct) * (1 + cos(pi p)) / 2
        wrong:   max_value_wrong + (min_value_wrong - max_value_wrong) * (1 + cos(pi p)) / 2

    A short correct answer earns max_value_correct, a long one min_value_correct; a short wrong one
    costs min_value_wrong, a long one only max_value_wrong (long wrong attempts are punished less:
    exploration). None where the solution does not parse, as accuracy_reward."""
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"max_len must be a positive number of tokens, got {max_len!r}")
    values = {"min_value_wrong": min_value_wrong, "max_value_wrong": max_value_wrong,
              "min_value_correct": min_value_correct, "max_value_correct": max_value_correct}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    return CosineScaledReward(max_len, **{name: float(value) for name, value in values.items()})


class CosineScaledReward:
    """The reward get_cosine_scaled_reward returns: a class, not a closure, so that it pickles."""

    __name__ = "cosine_scaled_reward"  # TRL's: the reward's name in the logs

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float) -> None:
        self.max_len = max_len
        # (value at length 0, value at max_len and beyond) for correct and for wrong answers
        self.correct = (max_value_correct, min_value_correct)
        self.wrong = (min_value_wrong, max_value_wrong)

    def __call__(self, completions: list, completion_ids: list[list[int]], solution: list | None = None,
                 **columns) -> list[float | None]:
        rewards = []
        for correct, ids in zip(accuracy_reward(completions, solution, **columns), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            short, long = self.correct if correct else self.wrong
            # Past max_len the schedule stays at its end: cos would climb back up.
            weight = (1.0 + math.cos(math.pi * min(len(ids) / self.max_len, 1.0))) / 2
            rewards.append(long + (short - long) * weight)
        return rewards


def _gold_and_texts(reward: str, completions: list, solution: list | None,
                    columns: dict) -> list[tuple[object | None, str]]:
    """(the solution parsed by math-verify, or None where it does not parse; the completion's text) per
    completion."""
    if solution is None:
        data_columns = sorted(set(columns) - _CALL_ARGUMENTS)
        raise ValueError(f"{reward} needs a `solution` column (each prompt's reference answer, as in TRL): the "
                         f"data's columns are {', '.join(data_columns) or 'none but the prompt'}")
    if len(solution) != len(completions):
        raise ValueError(f"{reward}: {len(solution)} solutions for {len(completions)} completions")
    parse = _math_verify().parse
    timeout = _timeout(PARSE_TIMEOUT_S)
    pairs = []
    for reference, completion in zip(solution, completions):
        gold = parse("" if reference is None else str(reference), parsing_timeout=timeout)
        pairs.append((gold if gold else None, completion_text(completion)))
    return pairs


# What a reward call passes beside the completions and the data's columns (driver/rewards/functions.py).
_CALL_ARGUMENTS = {"prompts", "completion_ids", "trainer_state", "environment_reward"}


def _answer_is(gold, text: str) -> float:
    """1.0 when the text's answer, extracted as TRL extracts it, equals the parsed solution, else 0.0."""
    math_verify = _math_verify()
    answer = math_verify.parse(text, extraction_config=[math_verify.answer_extraction], extraction_mode="first_match",
                               parsing_timeout=_timeout(PARSE_TIMEOUT_S))
    return float(math_verify.verify(gold, answer, timeout_seconds=_timeout(VERIFY_TIMEOUT_S)))


class _MathVerify:
    """math-verify's functions, and the extraction TRL's math rewards use on completions: LaTeX only,
    \\boxed{} answers first, none without an anchor (TRL's comment: an answer in correct LaTeX)."""

    def __init__(self) -> None:
        try:
            from latex2sympy2_extended import NormalizationConfig
            from math_verify import LatexExtractionConfig, parse, verify
        except ImportError as error:
            raise ImportError(f"the math rewards need math-verify ({error}): pip install math-verify==0.9.0, "
                              f"or pykernels' `math` extra") from None
        self.parse, self.verify = parse, verify
        self.answer_extraction = LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                       boxed_match_priority=0, try_extract_without_anchor=False)


@functools.cache
def _math_verify() -> _MathVerify:
    return _MathVerify()


def _timeout(seconds: int) -> int | None:
    """math-verify times itself with signal.alarm, which only the main thread may set: elsewhere (a
    reward called from a thread, with reward_num_workers 0) it runs without a limit, as in TRL, and its
    warning that it does is silenced. Reward workers call in their main thread: limited."""
    if threading.current_thread() is threading.main_thread():
        return seconds
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return None
