"""The rollout pipeline without vLLM: the version schedule, partial rollouts, the prefetch thread,
staleness, streaming scoring, re-rolls and checkpoint state (tests/async_fakes.py stands in for
the engine, the policy and the tokenizer)."""

import json
import threading

import pytest
import torch
from pydantic import ValidationError

from driver.config import Config
from driver.data.prompts import PromptSource
from driver.rollouts.producer import Producer
from driver.config import schedule_staleness
from driver.rollouts.schedule import job_version, staleness, versions_kept
from tests.async_fakes import COMPLETION_BASE, FakeGenerator, FakeTokenizer, make_rollouts, run_steps

PROMPTS = ["alpha", "bravo", "flat charlie", "delta", "echo", "flat foxtrot", "golf", "hotel"]


def make_config(tmp_path, **sections) -> Config:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    base = {"data": {"source": str(data), "shuffle": False},
            "rewards": {"functions": [{"path": "tests.async_fakes.length_parity"}]},
            "algo": {"num_generations": 4},
            "train": {"prompts_per_step": 2, "micro_batch_size": 4, "steps": 20},
            "rollout": {"verify_sync": False, "sampling": {"max_tokens": 10}},
            "logging": {"output_dir": str(tmp_path / "out")}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return Config.model_validate(base)


# -- the schedule --

@pytest.mark.parametrize("depth, interval, expected", [
    (0, 1, [0, 1, 2, 3, 4, 5, 6]),
    (1, 1, [0, 0, 1, 2, 3, 4, 5]),
    (2, 1, [0, 0, 0, 1, 2, 3, 4]),
    (1, 3, [0, 0, 0, 0, 3, 3, 3]),
    (0, 2, [0, 0, 2, 2, 4, 4, 6]),
])
def test_job_version_follows_depth_and_sync_interval(depth, interval, expected):
    versions = [job_version(j, depth, interval) for j in range(7)]
    assert versions == expected
    for job in range(depth, 40):  # steady state: staleness within [d, d + k - 1]
        assert depth <= staleness(job, job_version(job, depth, interval)) <= schedule_staleness(depth, interval)


def test_versions_kept_cover_every_job_not_yet_consumed():
    for depth in range(4):
        for interval in range(1, 5):
            for pushed in range(0, 30, interval):  # right after the push of version `pushed`
                oldest_needed = min(job_version(j, depth, interval) for j in range(pushed, pushed + depth + 1))
                kept = [v for v in range(0, pushed + 1, interval)][-versions_kept(depth, interval):]
                assert oldest_needed in kept


def test_config_rejects_a_staleness_bound_the_schedule_always_exceeds(tmp_path):
    with pytest.raises(ValidationError, match="max_staleness = 1 would drop every batch"):
        make_config(tmp_path, rollout={"async_prefetch": True, "prefetch_depth": 2, "max_staleness": 1})
    with pytest.raises(ValidationError, match="partial_rollout_tokens = 10 must be below"):
        make_config(tmp_path, rollout={"partial_rollout_tokens": 10})
    config = make_config(tmp_path, rollout={"async_prefetch": True, "vllm_sync_interval": 2})
    assert config.max_staleness == 2 and config.prefetch_depth == 1


# -- partial rollouts --

def producer_for(config, generator):
    tokenizer = FakeTokenizer()
    return Producer(config, generator, PromptSource(config.data, tokenizer, 0), tokenizer)


def test_partial_rollouts_continue_from_token_ids_with_one_span_per_version(tmp_path):
    config = make_config(tmp_path, rollout={"partial_rollout_tokens": 4, "max_staleness": 5},
                         train={"prompts_per_step": 1})
    generator = FakeGenerator(lengths=(10, 10, 10, 10))  # every sample needs 10 tokens: rounds of 4, 4, 2
    producer = producer_for(config, generator)
    # Within one job, rounds repeat until the quota is met, all with the job's version:
    group = producer.produce(1, version=1).groups[0]
    for sample in group.samples:
        assert len(sample.token_ids) == 10 and sample.finish_reason == "stop"
        assert [(s.start, s.end) for s in sample.spans] == [(0, 4), (4, 8), (8, 10)]
    rounds = [request for version, request in generator.requests if version == 1]
    fresh, continued = rounds[0], rounds[1:]
    assert fresh.n == 4 and fresh.max_tokens == 4 and fresh.token_ids == group.prompt.token_ids
    first_continuation = continued[0]
    assert first_continuation.n == 1 and first_continuation.max_tokens == 4
    assert first_continuation.token_ids[: len(group.prompt.token_ids)] == group.prompt.token_ids
    assert len(first_continuation.token_ids) == len(group.prompt.token_ids) + 4
    assert sorted(r.max_tokens for r in continued)[:4] == [2, 2, 2, 2]  # the remaining budget, not max_tokens


def test_unfinished_groups_are_continued_by_the_next_jobs_version(tmp_path):
    config = make_config(tmp_path, rollout={"partial_rollout_tokens": 4, "max_staleness": 5},
                         train={"prompts_per_step": 2})
    generator = FakeGenerator(lengths=(2, 3, 2, 3, 2, 9, 2, 3))
    producer = producer_for(config, generator)
    jobs = [producer.produce(job, version=job) for job in range(6)]
    groups = [group for job in jobs for group in job.groups]
    continued = [g for g in groups if len({s.version for sample in g.samples for s in sample.spans}) > 1]
    assert continued, "some group was carried into the next job"
    for group in groups:
        for sample in group.samples:  # behaviour logprobs per token: each span's own version's
            for span in sample.spans:
                assert sample.logprobs[span.start:span.end] == [pytest.approx(-0.1 * (span.version + 1))] * (
                    span.end - span.start)
            assert sample.version == min(s.version for s in sample.spans)
            assert [s.end for s in sample.spans][-1] == len(sample.token_ids)
    assert sum(job.metrics["partial/continued_samples"] for job in jobs) > 0
    assert all(0 < job.metrics["partial/truncation_rate"] < 1 for job in jobs if job.metrics["rollout/rounds"] > 1)


def test_a_partial_group_that_waited_too_long_is_dropped_and_its_prompt_generated_again(tmp_path):
    config = make_config(tmp_path, rollout={"partial_rollout_tokens": 2, "max_staleness": 1},
                         train={"prompts_per_step": 1})
    generator = FakeGenerator(lengths=(9, 2, 2, 2))  # one sample of the first prompt needs 5 rounds
    producer = producer_for(config, generator)
    producer.produce(0, version=0)
    waiting = list(producer.in_flight)
    assert waiting and waiting[0].version == 0
    job = producer.produce(2, version=2)  # the waiting group would be 2 versions old: over max_staleness
    assert job.metrics["rollout/dropped_stale"] == len(waiting) == job.metrics["rollout/regenerated_stale"]
    trained = [g for g in job.groups]
    assert all(2 - g.version <= 1 for g in trained)
    regenerated = [g for g in trained + producer.in_flight if g.prompt.index == waiting[0].prompt.index
                   and g.group_id != waiting[0].group_id]
    assert regenerated and all(len(s.spans) >= 1 for g in regenerated for s in g.samples if s.token_ids)


def test_continued_tokens_count_as_completion_tokens_of_the_batch(tmp_path):
    config = make_config(tmp_path, rollout={"partial_rollout_tokens": 3, "max_staleness": 5},
                         algo={"zero_advantage": "skip"})
    rollouts = make_rollouts(config, FakeGenerator(lengths=(7, 2, 8, 3)))
    try:
        batch = run_steps(rollouts, 2)[1]
    finally:
        rollouts.close()
    lengths = [len(c) for c in batch.completion_ids]
    assert batch.mask.sum(dim=1).tolist() == lengths and max(lengths) > 3
    for row, ids in enumerate(batch.completion_ids):
        assert ids[0] - COMPLETION_BASE == len(ids) or len(ids) == config.rollout.sampling.max_tokens
        assert (batch.sampling_logprobs[row, len(ids):] == 0).all()
    assert batch.metrics["completions/continued_fraction"] > 0


# -- the prefetch thread --

def test_prefetched_jobs_arrive_in_order_each_sampled_by_its_scheduled_version(tmp_path):
    config = make_config(tmp_path, rollout={"async_prefetch": True, "prefetch_depth": 2})
    generator = FakeGenerator()
    rollouts = make_rollouts(config, generator)
    try:
        batches = run_steps(rollouts, 6)
    finally:
        rollouts.close()
    versions = [b.metrics["rollout/version"] for b in batches]
    assert versions == [job_version(j, 2, 1) for j in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [b.metrics["rollout/staleness_max"] for b in batches[2:]] == [2, 2, 2, 2]
    assert generator.overlaps == 0  # no engine call (generation or sync) ran inside another


def test_async_and_sync_runs_produce_the_same_groups_when_versions_agree(tmp_path):
    """Versions and seeds are pure functions of the job: with a fake whose samples do not depend on
    the version, the async pipeline yields exactly the synchronous batches."""
    sync_config = make_config(tmp_path, algo={"zero_advantage": "skip"})
    async_config = make_config(tmp_path, rollout={"async_prefetch": True}, algo={"zero_advantage": "skip"})
    results = []
    for config in (sync_config, async_config):
        rollouts = make_rollouts(config, FakeGenerator())
        try:
            results.append([(b.prompt_ids, b.completion_ids, b.advantages.tolist()) for b in run_steps(rollouts, 5)])
        finally:
            rollouts.close()
    assert results[0] == results[1]


def test_a_sync_never_changes_the_version_of_a_generation_in_flight(tmp_path):
    config = make_config(tmp_path, rollout={"async_prefetch": True})
    generator = FakeGenerator()
    generator.gate.clear()  # job 0 blocks inside the engine call
    rollouts = make_rollouts(config, generator)
    try:
        pushed = threading.Thread(target=rollouts.push, args=(1,))
        pushed.start()
        pushed.join(0.3)
        assert pushed.is_alive(), "the push waits for the engine"
        generator.gate.set()
        pushed.join(5)
        # Version 1 is served before job 1 starts, yet job 1 samples with its scheduled version 0.
        assert [rollouts.next_batch(j).metrics["rollout/version"] for j in (0, 1)] == [0, 0]
    finally:
        generator.gate.set()
        rollouts.close()
    assert generator.overlaps == 0


def test_single_version_engines_get_a_new_version_only_after_every_older_job(tmp_path):
    config = make_config(tmp_path, rollout={"async_prefetch": True, "prefetch_depth": 2})
    generator = FakeGenerator(serves_one_version=True, delay=0.01)
    rollouts = make_rollouts(config, generator)
    try:
        run_steps(rollouts, 6)  # FakeGenerator raises if a job runs with weights of another version
    finally:
        rollouts.close()
    order = [(kind, version) for kind, version, _, _ in sorted(generator.calls, key=lambda call: call[2])]
    syncs = [i for i, (kind, _) in enumerate(order) if kind == "sync"]
    for index in syncs:
        version = order[index][1]
        assert all(v >= version for kind, v in order[index:] if kind == "stream")


def test_rewards_of_prefetched_groups_arrive_keyed_whatever_the_order(tmp_path):
    config = make_config(tmp_path, rollout={"async_prefetch": True}, algo={"zero_advantage": "skip"})
    rollouts = make_rollouts(config, FakeGenerator())
    try:
        batch = run_steps(rollouts, 2)[1]
    finally:
        rollouts.close()
    for (prompt, completion, reward) in batch.samples:  # FakeGenerator yields groups in reverse order
        flat = "flat" in prompt
        length = int(completion.split()[0]) - COMPLETION_BASE
        assert reward == (0.0 if flat else float(length % 2 == 0))


# -- filtering, re-rolls and checkpoints through the pipeline --

def test_zero_signal_groups_leave_the_batch_and_are_counted(tmp_path):
    config = make_config(tmp_path, train={"prompts_per_step": 3})  # prompts 0-2: "flat charlie" has no signal
    rollouts = make_rollouts(config, FakeGenerator())
    try:
        batch = rollouts.next_batch(0)
    finally:
        rollouts.close()
    assert batch.metrics["frac_reward_zero_std"] == pytest.approx(1 / 3)
    assert all("flat" not in prompt for prompt, _, _ in batch.samples)
    assert batch.counts.num_sequences == 12 and len(batch) == 8


def test_groups_that_failed_entirely_come_back_later(tmp_path):
    config = make_config(tmp_path, train={"prompts_per_step": 3, "steps": 10},
                         algo={"reroll_failed": True, "reroll_after": 0.2, "reroll_max_attempts": 2})
    generator = FakeGenerator()
    rollouts = make_rollouts(config, generator)
    try:
        run_steps(rollouts, 6)
    finally:
        rollouts.close()
    fresh = [r.token_ids for v, r in generator.requests if r.n == 4]
    jobs = [fresh[i: i + 3] for i in range(0, len(fresh), 3)]
    flat = FakeTokenizer()("flat charlie").input_ids
    assert jobs[0][2] == flat  # data order (no shuffle): alpha, bravo, flat charlie | delta, echo, flat foxtrot
    # delay_steps = 0.2 x 10 = 2: job 2 starts with the failed prompts of job 0, before golf and hotel
    assert jobs[2][0] == flat and FakeTokenizer()("golf").input_ids in jobs[2]


def test_a_checkpoint_under_prefetch_loses_no_prompt(tmp_path):
    config = make_config(tmp_path, rollout={"async_prefetch": True, "prefetch_depth": 2},
                         algo={"zero_advantage": "skip"})
    whole = make_rollouts(config, FakeGenerator())
    try:
        expected = [b.prompt_ids for b in run_steps(whole, 6)]
    finally:
        whole.close()
    first = make_rollouts(config, FakeGenerator())
    try:
        got = [b.prompt_ids for b in run_steps(first, 3)]
        state = torch.load(_saved(first.state_dict(), tmp_path), weights_only=False)
    finally:
        first.close()
    resumed = make_rollouts(config, FakeGenerator(), start_step=3, state=state)
    try:
        got += [b.prompt_ids for b in run_steps(resumed, 3, start=3)]
    finally:
        resumed.close()
    assert got == expected


def _saved(state, tmp_path):
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_filtered_groups_are_refilled_from_the_replay_buffer_with_their_stored_rows(tmp_path):
    config = make_config(tmp_path, train={"prompts_per_step": 3}, algo={"replay_buffer_size": 4, "replay_max_age": 1})
    rollouts = make_rollouts(config, FakeGenerator())
    try:
        first, second = run_steps(rollouts, 2)
    finally:
        rollouts.close()
    # Step 2 (prompts delta, echo, flat foxtrot): the flat group leaves, a step-1 group takes its place.
    assert second.metrics["replay/replayed_groups"] == 1 and second.metrics["filter/filtered_sequences"] >= 4
    replayed_rows = [row for row, version in enumerate(second.versions) if version == 0]
    assert len(replayed_rows) == 4 and replayed_rows == list(range(len(second) - 4, len(second)))
    # The rows are the stored group's, token for token, with its sampling logprobs (behaviour policy).
    stored = {tuple(c): row for row, c in enumerate(first.completion_ids)}
    for row in replayed_rows:
        original = stored[tuple(second.completion_ids[row])]
        assert second.prompt_ids[row] == first.prompt_ids[original]
        width = len(second.completion_ids[row])
        assert torch.equal(second.sampling_logprobs[row, :width], first.sampling_logprobs[original, :width])
        assert second.mask[row].sum() == width and second.advantages[row] == first.advantages[original]
    assert second.counts.num_sequences == 12 + 4  # the unfiltered step plus the replayed rows
