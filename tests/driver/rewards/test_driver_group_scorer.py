"""driver.rewards.group_scorer: groups submitted from a generation thread are scored by the workers while
the trainer's thread does something else (the pump keeps the pool fed), and wait() hands each
result to its group."""

import threading
import time

import pytest

from driver.config import Config
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample
from driver.rewards.group_scorer import GroupScorer


def group(group_id: int, texts: list[str]) -> Group:
    samples = [Sample([1] * len(t), [0.0] * len(t), "stop") for t in texts]
    return Group(group_id, Prompt(group_id, f"prompt {group_id}", [1, 2]), samples, texts=texts)


@pytest.fixture(scope="module")
def scorer():
    config = Config.model_validate({"rewards": {
        "functions": [{"path": "tests.reward_fixtures.sleep_then_length"}], "reward_num_workers": 1}})
    scorer = GroupScorer(config)
    yield scorer
    scorer.close()


def test_queued_groups_are_scored_while_nobody_waits(scorer):
    groups = [group(i, ["a" * (i + 1), "bb"]) for i in range(3)]  # one worker: two calls queue behind the first
    submitter = threading.Thread(target=lambda: [scorer.submit_group(g) for g in groups])
    submitter.start()
    submitter.join()
    time.sleep(3 * 0.2 + 1.0)  # the trainer "updates": nobody calls wait()
    started = time.perf_counter()
    results = scorer.wait([2, 0, 1])
    assert time.perf_counter() - started < 0.15, "the queued calls ran during the sleep, not in wait()"
    assert {key: results[key].table[:, 0].tolist() for key in results} == {0: [1.0, 2.0], 1: [2.0, 2.0],
                                                                            2: [3.0, 2.0]}


def test_inline_scoring_answers_at_submit_and_rejects_unknown_groups():
    scorer = GroupScorer(Config.model_validate({"rewards": {
        "functions": [{"path": "tests.reward_fixtures.length_or_none"}]}}))
    try:
        assert not scorer.in_workers
        scorer.submit_group(group(7, ["abc", ""]))
        table = scorer.wait([7])[7].table
        assert table[0, 0] == 3.0
        with pytest.raises(KeyError, match=r"groups \[8\] were never submitted"):
            scorer.wait([8])
    finally:
        scorer.close()
