"""driver.rollouts.reroll: which groups count as failed, and when (and how often) their prompts come back."""

import io
import math

import pytest
import torch

from driver.data.prompts import Prompt
from driver.data.records import Group, Sample, Span
from driver.rollouts.reroll import RerollQueue, delay_steps, failed_entirely


def make_group(index: int, totals: list[float], attempts: int = 1, failure: str | None = None) -> Group:
    samples = [Sample([index, row], [-0.1, -0.2], "stop", [Span(0, 2, 0)]) for row in range(len(totals))]
    prompt = Prompt(index, f"prompt {index}", [0, index], {"answer": str(index), "tags": ["hard"]})
    return Group(group_id=index, prompt=prompt, samples=samples, attempts=attempts, failure=failure,
                 total=torch.tensor(totals))


FAILURES = [  # (totals, threshold, failure, failed entirely)
    ([0.0, 0.0, 0.0], 0.0, None, True),
    ([0.0, 1.0, 0.0], 0.0, None, False),
    ([0.5, 0.5], 0.5, None, True),  # "at or below"
    ([0.5, 0.50001], 0.5, None, False),
    ([-1.0, -2.0], 0.0, None, True),
    ([math.nan, math.nan], 0.0, None, True),
    ([math.nan, 1.0], 0.0, None, False),
    ([1.0, 1.0], 0.0, "accuracy raised ValueError", True),
]


@pytest.mark.parametrize("totals,threshold,failure,expected", FAILURES)
def test_failed_entirely_means_no_sample_above_the_threshold_or_scoring_failed(totals, threshold, failure, expected):
    assert failed_entirely(make_group(0, totals, failure=failure), threshold) is expected


def test_a_failed_group_returns_after_delay_steps_with_one_more_attempt():
    queue = RerollQueue(delay_steps=3, max_attempts=3, capacity=4)
    group = make_group(7, [0.0, 0.0])
    assert queue.push(group, step=2)
    assert queue.due(step=4, limit=8) == []
    (prompt, attempts), = queue.due(step=5, limit=8)
    assert prompt == group.prompt and attempts == 2
    assert len(queue) == 0 and queue.due(step=9, limit=8) == []
    assert queue.metrics()["reroll/rerolled"] == 1


def test_nothing_returns_before_the_start_step_then_at_most_per_step_a_step():
    """axolotl's reroll_start_fraction x steps and reroll_max_groups: prompts that failed early wait for
    the start step, then come back oldest first, per_step at a time."""
    queue = RerollQueue(delay_steps=1, max_attempts=3, capacity=8, start_step=5, per_step=2)
    for index in range(5):
        assert queue.push(make_group(index, [0.0, 0.0]), step=index)
    assert queue.due(step=4, limit=8) == []  # due since steps 1..4, but before the start
    assert [prompt.index for prompt, _ in queue.due(step=5, limit=8)] == [0, 1]
    assert [prompt.index for prompt, _ in queue.due(step=6, limit=1)] == [2]  # the step's own limit is lower
    assert [prompt.index for prompt, _ in queue.due(step=7, limit=8)] == [3, 4] and len(queue) == 0


def test_a_prompt_is_rolled_at_most_max_attempts_times_then_given_up():
    queue = RerollQueue(delay_steps=1, max_attempts=3, capacity=4)
    group, rolls, step = make_group(0, [0.0]), 1, 0
    while queue.push(group, step):
        step += 1
        (prompt, attempts), = queue.due(step, limit=1)
        group, rolls = make_group(prompt.index, [0.0], attempts=attempts), rolls + 1
    assert rolls == 3 and group.attempts == 3
    assert queue.metrics() == {"reroll/queued": 0.0, "reroll/given_up": 1.0, "reroll/dropped_full": 0.0,
                               "reroll/rerolled": 2.0}


def test_a_full_queue_drops_and_counts_the_push():
    queue = RerollQueue(delay_steps=1, max_attempts=5, capacity=2)
    assert [queue.push(make_group(i, [0.0]), step=0) for i in range(3)] == [True, True, False]
    assert queue.metrics()["reroll/dropped_full"] == 1 and queue.metrics()["reroll/queued"] == 2
    queue.due(step=1, limit=1)
    assert queue.push(make_group(3, [0.0]), step=1)


def test_due_serves_the_oldest_due_first_ties_in_push_order_up_to_the_limit():
    queue = RerollQueue(delay_steps=2, max_attempts=5, capacity=8)
    for index, step in [(0, 3), (1, 1), (2, 3), (3, 1), (4, 6)]:
        queue.push(make_group(index, [0.0]), step)
    assert [prompt.index for prompt, _ in queue.due(step=5, limit=3)] == [1, 3, 0]
    assert [prompt.index for prompt, _ in queue.due(step=5, limit=3)] == [2]  # 4 is due at step 8
    assert queue.due(step=5, limit=0) == [] and len(queue) == 1


def test_capacity_zero_turns_reroll_off():
    queue = RerollQueue(delay_steps=1, max_attempts=2, capacity=0)
    assert not queue.push(make_group(0, [0.0]), step=0)
    assert queue.metrics()["reroll/dropped_full"] == 1


def test_state_round_trips_through_torch_save_loaded_with_weights_only():
    queue = RerollQueue(delay_steps=2, max_attempts=2, capacity=3)
    for index, step in [(0, 1), (1, 0), (2, 1), (3, 1)]:  # the last is dropped: full
        queue.push(make_group(index, [0.0]), step)
    queue.push(make_group(4, [0.0], attempts=2), step=1)  # given up
    queue.due(step=2, limit=1)
    saved = io.BytesIO()
    torch.save(queue.state_dict(), saved)
    saved.seek(0)
    restored = RerollQueue(delay_steps=2, max_attempts=2, capacity=3)
    restored.load_state_dict(torch.load(saved, weights_only=True))
    assert restored.state_dict() == queue.state_dict()
    assert restored.metrics() == queue.metrics()
    for step in (2, 3):  # the same pushes and serves from here on
        for q in (queue, restored):
            q.push(make_group(10 + step, [0.0]), step)
        assert restored.due(step + 1, limit=2) == queue.due(step + 1, limit=2)
    assert restored.state_dict() == queue.state_dict()


@pytest.mark.parametrize("fraction,total_steps,expected", [(0.1, 30, 3), (0.5, 7, 4), (0.0, 10, 1), (0.01, 10, 1),
                                                           (1.0, 5, 5)])
def test_delay_steps_is_a_fraction_of_training_and_at_least_one(fraction, total_steps, expected):
    assert delay_steps(fraction, total_steps) == expected


BAD_ARGUMENTS = [
    (lambda: RerollQueue(delay_steps=0, max_attempts=2, capacity=1), "delay_steps"),
    (lambda: RerollQueue(delay_steps=1, max_attempts=0, capacity=1), "max_attempts"),
    (lambda: RerollQueue(delay_steps=1, max_attempts=2, capacity=-1), "capacity"),
    (lambda: RerollQueue(delay_steps=1, max_attempts=2, capacity=1).due(0, limit=-1), "limit"),
    (lambda: delay_steps(1.5, 10), "fraction"),
    (lambda: delay_steps(0.5, 0), "total_steps"),
    (lambda: failed_entirely(Group(0, Prompt(0, "p", [1]), []), 0.0), "total"),
]


@pytest.mark.parametrize("call,argument", BAD_ARGUMENTS, ids=[argument for _, argument in BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()
