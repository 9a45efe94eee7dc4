"""A NeMo Gym /run answer as one training sequence (driver/environments/nemo_gym_episode.py), from hand-written
answers shaped as simple_agent + vllm_model (return_token_id_information) return them: token fields on the last
output item of each model call, tool results between calls."""

import pytest
import torch

from driver.data.prompts import Prompt
from driver.data.records import Group, Span
from driver.environments.episodes import episode_stats
from driver.environments.nemo_gym_episode import episode_from_run, tool_failed
from driver.rollouts.batch import batch_from_groups

PROMPT = [1, 2, 3, 4]
EOS = 9
VERSION = 5


def call_item(prompt, generation, kind="message", text="hi", **fields) -> dict:
    item = {"type": kind, "prompt_token_ids": list(prompt), "generation_token_ids": [str(t) for t in generation],
            "generation_log_probs": [-0.1 * (i + 1) for i in range(len(generation))], **fields}
    if kind == "message":
        item.update(role="assistant", content=[{"type": "output_text", "text": text, "annotations": []}])
    return item


def function_call(prompt, generation, name="get_weather", arguments='{"city": "sf"}', call_id="c1") -> dict:
    return call_item(prompt, generation, kind="function_call", name=name, arguments=arguments, call_id=call_id)


def tool_output(output: str, call_id="c1") -> dict:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def answer(*items, reward=1.0, incomplete=None) -> dict:
    return {"responses_create_params": {"input": "q"}, "reward": reward,
            "response": {"output": list(items), "incomplete_details": incomplete}}


def two_turn_run(second_prompt=None, output='{"city": "sf", "weather_description": "cold"}', max_tokens=100):
    first_generation = [10, 11, EOS]
    environment = [20, 21, 22]
    second_prompt = PROMPT + first_generation + environment if second_prompt is None else second_prompt
    run = answer(function_call(PROMPT, first_generation), tool_output(output),
                 call_item(second_prompt, [30, 31, EOS], text="cold"))
    return episode_from_run(run, VERSION, max_tokens)


def test_turns_and_environment_tokens_make_one_sequence():
    run = two_turn_run()
    sample, episode = run.sample, run.sample.episode
    assert run.prompt_ids == PROMPT
    assert sample.token_ids == [10, 11, EOS, 20, 21, 22, 30, 31, EOS]
    assert sample.logprobs == pytest.approx([-0.1, -0.2, -0.3, 0, 0, 0, -0.1, -0.2, -0.3])
    assert episode.environment_spans == [(3, 6)]
    assert sample.finish_reason == "stop" and episode.done and episode.reward == 1.0
    assert episode.turns == 2 and episode.tool_calls == 1 and episode.tool_failures == 0
    assert sample.spans == [Span(0, 9, VERSION)]
    assert [message["role"] for message in episode.messages] == ["assistant", "tool", "assistant"]
    assert episode.messages[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "sf"}}


def test_loss_and_importance_weights_only_on_generated_tokens():
    run = two_turn_run()
    group = Group(0, Prompt(0, "q", run.prompt_ids), [run.sample], advantages=torch.ones(1), total=torch.ones(1))
    batch = batch_from_groups([group])
    assert batch.mask[0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert batch.prompt_ids == [PROMPT]
    assert batch.sampling_logprobs[0, 3:6].tolist() == [0, 0, 0]


@pytest.mark.parametrize("second_prompt", [
    [1, 2, 3, 4, 10, 11, 20, 21],  # the template dropped the EOS the model sampled
    [1, 2, 3, 4, 10, 12, EOS, 20],  # it re-serialized the tool call
    [1, 2, 3, 4, 10, 11],  # shorter than what came before
], ids=["eos-dropped", "re-rendered", "shorter"])
def test_a_prompt_that_does_not_extend_the_sequence_cuts_the_episode(second_prompt):
    run = two_turn_run(second_prompt)
    sample, episode = run.sample, run.sample.episode
    assert sample.token_ids == [10, 11, EOS] and sample.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert episode.environment_spans == [] and episode.turns == 1
    assert episode.prefix_mismatch and not episode.done and sample.finish_reason == "length"
    assert episode.reward == 1.0  # the outcome of what the model did; the cut turns are not trained
    stats = episode_stats([Group(0, Prompt(0, "q", PROMPT), [sample, two_turn_run().sample])])
    assert stats["episodes/prefix_mismatch_fraction"] == 0.5


def test_tokens_past_max_tokens_cut_the_episode_without_a_mismatch():
    run = two_turn_run(max_tokens=8)
    assert run.sample.token_ids == [10, 11, EOS] and run.sample.finish_reason == "length"
    assert not run.sample.episode.prefix_mismatch


def test_an_empty_generation_adds_no_tokens_and_the_next_prompt_extends():
    run = episode_from_run(answer(call_item(PROMPT, [], text=""),), VERSION, 100)
    assert run.prompt_ids == PROMPT and run.sample.token_ids == [] and run.sample.finish_reason == "stop"
    assert run.sample.version == VERSION and run.sample.episode.turns == 1


def test_a_truncated_last_call_is_length():
    run = episode_from_run(answer(call_item(PROMPT, [10, 11]), incomplete={"reason": "max_output_tokens"}),
                           VERSION, 100)
    assert run.sample.token_ids == [10, 11] and run.sample.finish_reason == "length"
    assert not run.sample.episode.done


def test_a_run_without_token_information_is_an_empty_truncated_sample():
    """vllm_model answers a prompt over the context with an empty completion that carries no token ids."""
    empty = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ""}]}
    run = episode_from_run(answer(empty, incomplete={"reason": "max_output_tokens"}, reward=0.0), VERSION, 100)
    assert run.prompt_ids is None and run.sample.token_ids == [] and run.sample.finish_reason == "length"
    assert run.sample.version == VERSION and run.sample.episode.reward == 0.0


@pytest.mark.parametrize("output, failed", [
    ('{"error": "Invalid tool call arguments: JSONDecodeError()"}', True),  # simple_agent, malformed arguments
    ('{"detail": "Not Found"}', True),  # the resources server has no such tool
    ('{"city": "sf", "weather_description": "cold"}', False),
    ("plain text", False),
])
def test_tool_errors_count_as_failures(output, failed):
    assert tool_failed(output) is failed
    assert two_turn_run(output=output).sample.episode.tool_failures == int(failed)


def test_token_fields_must_be_complete_and_aligned():
    broken = call_item(PROMPT, [10, 11])
    broken["generation_log_probs"] = [-0.1]
    with pytest.raises(ValueError, match="2 generation_token_ids and 1 generation_log_probs"):
        episode_from_run(answer(broken), VERSION, 100)
    partial = call_item(PROMPT, [10])
    del partial["prompt_token_ids"]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        episode_from_run(answer(partial), VERSION, 100)
