"""driver.rewards.pool: reward calls in spawned worker processes give RewardFunctions' tables, survive
hung and crashed workers (replaced, retried once), never hand out a killed call's answer, run
signal.alarm rewards in the worker's main thread, and leave no process behind.

One 2-worker pool serves most of the module: tests that replace workers check counter deltas, not
absolute values. Misbehaviour is triggered by markers in the completions (tests/reward_fixtures.py),
so one configuration holds every fixture reward and ordinary groups score normally.
"""

import math
import time

import psutil
import pytest
import torch

from driver.cli import ConfigError
from driver.config import RewardFunction, RewardsConfig
from driver.data.prompts import Prompt
from driver.data.records import Group, Sample
from driver.rewards.functions import RewardError, RewardFunctions, group_call
from driver.rewards.pool import InlineRewards, RewardPool, make_reward_scorer
from tests.reward_fixtures import LATE_ANSWER, SLOW_SECONDS

TIMEOUT = 2.0  # seconds per call: fixture calls take milliseconds; the hang tests pay it once or twice
FIXTURES = ("length_or_none", "matches_answer", "alarm_in_main_thread", "arm_alarm_on_marker", "slow_once",
            "hang_on_marker", "crash_on_marker", "crash_once", "raise_on_marker", "wrong_length_on_marker")
CONFIG = RewardsConfig(functions=[RewardFunction(path=f"tests.reward_fixtures.{name}", weight=1.0 + index)
                                  for index, name in enumerate(FIXTURES)])
COLUMN = {name: index for index, name in enumerate(FIXTURES)}
ORDINARY = (["42", "", "4 2"], ["x", "42"], ["7"], ["", "", "abc", "42 "], ["forty-two", "42", "42"])  # odd G


@pytest.fixture(scope="module")
def pool():
    with RewardPool(CONFIG, num_workers=2, timeout=TIMEOUT) as shared:
        yield shared


def make_group(group_id: int, texts: list[str], marker_dir) -> Group:
    columns = {"prompt": f"question {group_id}", "answer": "42", "marker_dir": str(marker_dir), "id": group_id}
    prompt = Prompt(index=group_id, text=columns["prompt"], token_ids=[5, 6, 7], columns=columns)
    samples = [Sample(token_ids=[ord(c) for c in text], logprobs=[-1.0] * len(text), finish_reason="stop")
               for text in texts]
    return Group(group_id=group_id, prompt=prompt, samples=samples)


def submit(scorer, group_id: int, texts: list[str], marker_dir) -> Group:
    group = make_group(group_id, texts, marker_dir)
    scorer.submit(group_id, group_call(group, texts))
    return group


def in_process_table(groups: list[Group]) -> torch.Tensor:
    """The oracle: RewardFunctions once on every completion of the groups, as the sync driver calls it."""
    rows = [(group, sample) for group in groups for sample in group.samples]
    texts = [bytes(sample.token_ids).decode() for _, sample in rows]
    return RewardFunctions(CONFIG)(prompts=[g.prompt.text for g, _ in rows], completions=texts,
                                   columns=[g.prompt.columns for g, _ in rows],
                                   completion_ids=[s.token_ids for _, s in rows])


def counter_deltas(scorer, before: dict) -> dict[str, float]:
    return {name: value - before[name] for name, value in scorer.metrics().items() if value != before[name]}


def test_workers_give_the_in_process_table_whichever_worker_answers(pool, tmp_path):
    groups = [submit(pool, 100 + index, texts, tmp_path) for index, texts in enumerate(ORDINARY)]
    results = pool.wait([group.group_id for group in reversed(groups)])
    assert all(results[group.group_id].failure is None for group in groups)
    table = torch.cat([results[group.group_id].table for group in groups])
    torch.testing.assert_close(table, in_process_table(groups), rtol=0, atol=0, equal_nan=True)
    assert math.isnan(table[1, COLUMN["length_or_none"]])  # "" -> None -> NaN
    assert table[:, COLUMN["matches_answer"]].sum() == 4  # the answer column reached the workers
    assert pool.names == list(FIXTURES) and torch.equal(pool.weights, RewardFunctions(CONFIG).weights)


def test_a_hung_call_is_killed_on_timeout_and_retried_on_a_new_worker(pool, tmp_path):
    before, pids = pool.metrics(), set(pool.pids)
    submit(pool, 200, ["SLOW_ONCE", "b"], tmp_path)
    result = pool.wait([200])[200]
    assert result.failure is None and result.table[:, COLUMN["slow_once"]].tolist() == [2.0, 2.0]
    assert len(set(pool.pids) - pids) == 1  # the hung worker's successor
    assert counter_deltas(pool, before) == {"rewards/timeouts": 1, "rewards/worker_restarts": 1, "rewards/retries": 1}


def test_a_call_that_hangs_on_its_retry_too_fails_naming_the_reward_and_input(pool, tmp_path):
    before = pool.metrics()
    submit(pool, 300, ["HANG_ALWAYS please", "b"], tmp_path)
    failure = pool.wait([300])[300].failure
    assert failure.count("reward 'hang_on_marker' timed out after 2 s") == 2
    assert "prompt 'question 300'" in failure and "'HANG_ALWAYS please'" in failure
    assert counter_deltas(pool, before) == {"rewards/timeouts": 2, "rewards/worker_restarts": 2, "rewards/retries": 1,
                                            "rewards/failed_calls": 1}


def test_a_crashed_worker_is_replaced_and_its_call_retried_without_disturbing_other_calls(pool, tmp_path):
    before = pool.metrics()
    groups = [submit(pool, 400, ["CRASH_ONCE"], tmp_path), submit(pool, 401, ["42", "x"], tmp_path),
              submit(pool, 402, ["CRASH_ALWAYS now"], tmp_path), submit(pool, 403, ["", "42 "], tmp_path)]
    results = pool.wait([400, 401, 402, 403])
    failure = results[402].failure
    assert failure.count("reward 'crash_on_marker' crashed the worker (exit code 3)") == 2
    assert "prompt 'question 402'" in failure and "'CRASH_ALWAYS now'" in failure
    for group in (groups[0], groups[1], groups[3]):
        assert results[group.group_id].failure is None
        torch.testing.assert_close(results[group.group_id].table, in_process_table([group]), rtol=0, atol=0,
                                   equal_nan=True)
    assert counter_deltas(pool, before) == {"rewards/crashes": 3, "rewards/worker_restarts": 3, "rewards/retries": 2,
                                            "rewards/failed_calls": 1}


def test_a_timed_out_calls_late_answer_never_reaches_any_result(pool, tmp_path):
    started = time.monotonic()
    submit(pool, 500, ["SLOW_ONCE"], tmp_path)
    submit(pool, 501, ["a", "b"], tmp_path)
    first = pool.wait([500, 501])
    # Not synchronization: the later calls must run after the moment the slowed call would have answered.
    time.sleep(max(0.0, started + SLOW_SECONDS - time.monotonic()))
    later = [submit(pool, 502 + index, ["c"], tmp_path) for index in range(4)]
    results = [*first.values(), *pool.wait([group.group_id for group in later]).values(), *pool.poll()]
    assert len(results) == 6 and all(result.failure is None for result in results)
    assert all(LATE_ANSWER not in result.table for result in results)
    assert first[500].table[0, COLUMN["slow_once"]] == 2.0


def test_signal_alarm_rewards_run_in_the_workers_main_thread_and_leave_no_alarm_behind(tmp_path):
    with RewardPool(CONFIG, num_workers=1, timeout=TIMEOUT) as single:
        submit(single, 600, ["a"], tmp_path)
        submit(single, 601, ["ARM_ALARM"], tmp_path)
        submit(single, 602, ["b"], tmp_path)  # same worker: an alarm left armed would show as -1
        results = single.wait([600, 601, 602])
        assert [results[key].table[0, COLUMN["alarm_in_main_thread"]].item() for key in (600, 601, 602)] == [1.0] * 3
        assert single.metrics()["rewards/worker_restarts"] == 0


def test_a_python_exception_fails_the_call_with_its_traceback_and_is_not_retried(pool, tmp_path):
    before = pool.metrics()
    submit(pool, 700, ["RAISE", "b"], tmp_path)
    failure = pool.wait([700])[700].failure
    assert "reward 'raise_on_marker' raised an exception" in failure and "Traceback" in failure
    assert "ValueError: raise_on_marker refuses this completion" in failure and "'question 700'" in failure
    submit(pool, 701, ["42"], tmp_path)
    assert pool.wait([701])[701].failure is None
    assert counter_deltas(pool, before) == {"rewards/failed_calls": 1}


def test_a_bad_return_value_fails_the_call_with_reward_functions_message(pool, tmp_path):
    group = submit(pool, 800, ["WRONG_LENGTH", "b", "c"], tmp_path)
    failure = pool.wait([800])[800].failure
    with pytest.raises(RewardError) as raised:
        in_process_table([group])
    assert failure.startswith(str(raised.value)) and "returned list of length 1 for 3 completions" in failure


def test_inline_rewards_score_in_the_calling_thread_like_the_pool(tmp_path):
    with make_reward_scorer(CONFIG, num_workers=0, timeout=TIMEOUT) as inline:
        assert isinstance(inline, InlineRewards)
        groups = [submit(inline, 900 + index, texts, tmp_path) for index, texts in enumerate(ORDINARY)]
        submit(inline, 950, ["RAISE"], tmp_path)
        results = {result.key: result for result in inline.poll()}
        table = torch.cat([results[group.group_id].table for group in groups])
        torch.testing.assert_close(table, in_process_table(groups), rtol=0, atol=0, equal_nan=True)
        assert (table[:, COLUMN["alarm_in_main_thread"]] == 1.0).all()  # pytest's main thread
        assert "ValueError: raise_on_marker refuses" in results[950].failure
        assert inline.poll() == [] and inline.metrics()["rewards/failed_calls"] == 1


def test_keys_must_be_unique_until_collected_and_known_when_waited_for(pool, tmp_path):
    submit(pool, 1000, ["a"], tmp_path)
    with pytest.raises(ValueError, match="reward call 1000 was already submitted"):
        submit(pool, 1000, ["a"], tmp_path)
    with pytest.raises(ValueError, match=r"reward calls \[1001\] were never submitted"):
        pool.wait([1000, 1001])
    assert pool.wait([1000])[1000].failure is None


def test_a_bad_reward_path_fails_before_any_worker_starts():
    config = RewardsConfig(functions=[RewardFunction(path="tests.reward_fixtures.no_such_reward")])
    with pytest.raises(ConfigError, match=r"rewards.functions\[0\].path: module 'tests.reward_fixtures' has no"):
        RewardPool(config, num_workers=2, timeout=TIMEOUT)


def test_close_is_idempotent_and_leaves_no_child_process_even_with_a_hung_call(tmp_path):
    closing = RewardPool(CONFIG, num_workers=2, timeout=60.0)
    submit(closing, 1100, ["HANG_ALWAYS"], tmp_path)
    pids = set(closing.pids)
    closing.close()
    closing.close()
    assert not pids & {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(RuntimeError, match="the reward pool is closed"):
        closing.submit(1101, {})
