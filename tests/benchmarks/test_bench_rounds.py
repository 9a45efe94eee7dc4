"""How many timed rounds a benchmark case gets (benchmarks/conftest.py round_plan): fast calls fill
about a second, slow CPU calls are the best of two with the timed sizing call counted as one of them,
and a GPU repeats short launches inside a round."""

import pytest

from benchmarks.conftest import HEAVY_SECONDS, SLOW_CALL_SECONDS, TARGET_SECONDS_PER_CASE, round_plan


@pytest.mark.parametrize(("seconds", "expected"), [
    (0.001, (1, 50, False)),                       # capped at 50 rounds
    (0.1, (1, int(TARGET_SECONDS_PER_CASE / 0.1), False)),
    (0.9, (1, 3, False)),                           # never fewer than 3 below SLOW_CALL_SECONDS
    (SLOW_CALL_SECONDS, (1, 1, True)),              # the sizing call + one round: best of two
    (HEAVY_SECONDS + 10, (1, 1, True)),
])
def test_cpu_rounds(seconds, expected):
    assert round_plan(seconds, "cpu") == expected


def test_gpu_repeats_short_launches_and_never_counts_the_sizing_call():
    repeats, rounds, counted = round_plan(1e-5, "cuda")
    assert repeats == 200 and not counted and rounds == 50  # 2 ms a round
    assert round_plan(2.0, "cuda") == (1, 2, False)  # a single launch is no comparable round there
    assert round_plan(HEAVY_SECONDS, "cuda") == (1, 1, False)


def test_the_ci_class_times_only_what_its_rules_read():
    """On Zen 4 (CI) a run is timed when a rule of its [cpu-zen4] floors reads it: ours for every op with
    a rule, a baseline for the rules named after it, memory rules included; other classes time all."""
    from benchmarks.conftest import read_by_a_rule

    assert read_by_a_rule("moe", "forward_lora", "ours", "cpu-zen4")
    assert read_by_a_rule("moe", "forward_lora", "grouped_mm", "cpu-zen4")
    assert read_by_a_rule("moe", "forward_backward_base", "eager", "cpu-zen4")
    assert not read_by_a_rule("moe", "forward_backward_base", "grouped_mm", "cpu-zen4")
    assert not read_by_a_rule("moe", "forward_base", "ours", "cpu-zen4")  # no rule reads the op at all
    assert read_by_a_rule("logprobs", "forward_backward", "torch_materialized", "cpu-zen4")  # its memory rule
    assert not read_by_a_rule("logprobs", "forward", "torch_chunked", "cpu-zen4")
    assert read_by_a_rule("moe", "forward_base", "ours", "cpu")
    assert read_by_a_rule("moe", "forward_base", "eager", "h100")
