"""Multi-turn episodes in the rollout producer (driver/environments): the model's turns and the environment's
answers as one token sequence, environment tokens without loss, caps on turns and tokens, resume.

The engine is tests/environment_fixtures.py's ScriptedEngine (a fake: no model); the tokenizer and chat template
are the tiny Qwen2's. Expected token sequences are written by hand in ChatML, the tiny template's format.
"""

import copy
import json

import pytest
import torch

from driver.config import Config
from driver.data.prompts import PromptSource
from driver.data.records import Group, Sample, Span
from driver.data.tiny_model import resolve_model_path
from driver.environments.episodes import EpisodeRunner, episode_stats
from driver.environments.factory import episode_runner, make_factory, prompt_tools
from driver.environments.rewards import environment_reward
from driver.rewards.functions import group_call
from driver.rollouts.batch import batch_from_groups
from driver.rollouts.producer import Producer
from tests.environment_fixtures import ScriptedEngine, tool_call

ADD = "tests.environment_fixtures.add"
FAIL = "tests.environment_fixtures.fail"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def make_config(tmp_path, rows: list[dict], environment: dict, max_tokens: int = 96, algo: dict | None = None,
                **rollout) -> Config:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return Config.model_validate({
        "algo": algo or {"num_generations": 2}, "environment": environment,
        "data": {"source": str(data), "shuffle": False},
        "train": {"prompts_per_step": len(rows), "seed": 1},
        "rollout": {"verify_sync": False, "sampling": {"max_tokens": max_tokens}, **rollout}})


def produce(config, tokenizer, script, jobs: int = 1):
    engine = ScriptedEngine(tokenizer, script)
    prompts = PromptSource(config.data, tokenizer, config.train.seed, tools=prompt_tools(config, tokenizer))
    producer = Producer(config, engine, prompts, tokenizer, episodes=episode_runner(config, tokenizer))
    groups = [group for job in range(jobs) for group in producer.produce(job, version=job).groups]
    return groups, engine


def after_prompt(text: str) -> str:
    return text.split("<|im_start|>assistant\n", 1)[1]


def add_script(text: str, sample: int) -> str:
    """Sample 0 calls add(2, 3) and then answers with the tool's result; sample 1 answers at once."""
    episode = after_prompt(text)
    if sample == 1 and not episode:
        return "7"
    if "<|im_start|>tool" not in episode:
        return tool_call("add", a=2, b=3)
    return "The sum is " + episode.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] + "."


ADD_ROW = {"prompt": [{"role": "user", "content": "Add 2 and 3."}]}


def test_a_tool_episode_is_one_sequence_with_the_tool_result_masked(tmp_path, tokenizer):
    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD]})
    (group,), engine = produce(config, tokenizer, add_script)
    eos = tokenizer.eos_token_id
    called, answered = group.samples
    first = ids(tokenizer, tool_call("add", a=2, b=3)) + [eos]
    environment = ids(tokenizer, "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    final = ids(tokenizer, "The sum is 5.") + [eos]
    assert called.token_ids == first + environment + final
    assert called.logprobs == [-0.25] * len(first) + [0.0] * len(environment) + [-0.25] * len(final)
    assert called.finish_reason == "stop" and [span.version for span in called.spans] == [0, 0]
    episode = called.episode
    assert episode.environment_spans == [(len(first), len(first) + len(environment))]
    assert (episode.turns, episode.tool_calls, episode.tool_failures, episode.done) == (2, 1, 0, True)
    assert episode.messages == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "The sum is 5."}]
    assert answered.token_ids == ids(tokenizer, "7") + [eos] and answered.episode.turns == 1
    # The model's second turn continued from the very tokens of the first turn and the tool's answer.
    assert engine.calls[1][0].token_ids == group.prompt.token_ids + first + environment
    batch = batch_from_groups([_with_advantages(group)])
    assert batch.mask[0, : len(called.token_ids)].tolist() == [1.0] * len(first) + [0.0] * len(environment) + [
        1.0] * len(final)
    assert batch.mask[1].sum() == len(answered.token_ids)


def _with_advantages(group: Group) -> Group:
    group.advantages = torch.tensor([1.0, -1.0])
    group.total = torch.zeros(2)
    return group


def test_the_tools_schemas_are_rendered_into_the_prompt(tmp_path, tokenizer):
    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD]})
    _, schemas = make_factory(config.environment, tokenizer)
    assert schemas[0]["function"]["name"] == "add"
    assert schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    prompts = PromptSource(config.data, tokenizer, 1, tools=prompt_tools(config, tokenizer))
    expected = tokenizer.apply_chat_template(ADD_ROW["prompt"], add_generation_prompt=True, tools=schemas,
                                             return_dict=True)["input_ids"]
    assert prompts.prompts[0].token_ids == list(expected)


def test_failed_and_unknown_tool_calls_are_told_to_the_model_and_counted(tmp_path, tokenizer):
    def script(text, sample):
        episode = after_prompt(text)
        if "<|im_start|>tool" not in episode:
            return tool_call("fail", reason="boom") + tool_call("nope", x=1)
        return "done"

    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD, FAIL]}, max_tokens=400)
    (group,), _ = produce(config, tokenizer, script)
    episode = group.samples[0].episode
    assert (episode.tool_calls, episode.tool_failures, episode.done) == (2, 2, True)
    tool_messages = [message for message in episode.messages if message["role"] == "tool"]
    assert tool_messages == [{"role": "tool", "name": "fail", "content": "{'error': 'RuntimeError: boom'}"},
                             {"role": "tool", "name": "nope",
                              "content": "{'error': \"ValueError: no tool named 'nope' (tools: add, fail)\"}"}]
    stats = episode_stats([group])
    assert stats["tools/call_frequency"] == 2.0 and stats["tools/failure_frequency"] == 1.0


def test_an_episode_ends_after_max_turns_and_within_the_token_budget(tmp_path, tokenizer):
    def always_call(text, sample):
        return tool_call("add", a=1, b=1)

    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD], "max_turns": 3}, max_tokens=400)
    (group,), _ = produce(config, tokenizer, always_call)
    episode = group.samples[0].episode
    assert (episode.turns, len(episode.environment_spans), episode.done) == (3, 2, False)
    assert group.samples[0].finish_reason == "stop"

    turn = len(ids(tokenizer, tool_call("add", a=1, b=1))) + 1
    answer = len(ids(tokenizer, "<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"))
    # Room for two turns and one answer, not for the second answer: the episode is cut there ("length").
    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD], "max_turns": 8},
                         max_tokens=2 * turn + 2 * answer - 1)
    (group,), _ = produce(config, tokenizer, always_call)
    sample = group.samples[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 2 * turn + answer
    assert sample.episode.turns == 2 and len(sample.episode.environment_spans) == 1


def test_a_conversation_says_the_rows_user_turns_in_order(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Write digits."}], "user_turns": ["More.", "Again."]}]

    def script(text, sample):  # "<user turns heard> <sample>"; a continuation (n = 1) reads its sample from turn 1
        episode = after_prompt(text)
        return f"{episode.count('<|im_start|>user')} {episode[2] if episode else sample}"

    config = make_config(tmp_path, rows, {"name": "conversation"})
    (group,), _ = produce(config, tokenizer, script)
    sample = group.samples[1]
    eos = tokenizer.eos_token_id
    expected = (ids(tokenizer, "0 1") + [eos]
                + ids(tokenizer, "<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n")
                + ids(tokenizer, "1 1") + [eos]
                + ids(tokenizer, "<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
                + ids(tokenizer, "2 1") + [eos])
    assert sample.token_ids == expected
    assert [m["content"] for m in sample.episode.messages] == ["0 1", "More.", "1 1", "Again.", "2 1"]
    assert sample.episode.done and sample.episode.turns == 3


def test_partial_rollouts_pause_a_turn_without_stepping_the_environment(tmp_path, tokenizer):
    """A round budget of 3 tokens cuts every turn into pieces: the environment still sees whole turns,
    and the episodes are token for token those of unbudgeted rounds."""
    def script(text, sample):  # both samples call add, then answer (a continuation cannot tell its sample)
        return add_script(text, 0)

    whole, _ = produce(make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD]}), tokenizer, script)
    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD]}, partial_rollout_tokens=3)
    pieces, engine = produce(config, tokenizer, script, jobs=1)
    assert len(engine.calls) > 10  # many rounds of 3 tokens
    for a, b in zip(whole[0].samples, pieces[0].samples):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.episode == b.episode
        assert a.episode.turns == 2 and a.episode.done


def test_a_resumed_episode_replays_its_turns_into_a_fresh_environment(tmp_path, tokenizer):
    """The checkpoint holds the samples, not the environments: a new runner (a resumed run) resets a new
    environment and steps it on the recorded turns, then goes on exactly as the first runner would."""
    config = make_config(tmp_path, [ADD_ROW], {"name": "tests.environment_fixtures.CountingEnvironment",
                                               "kwargs": {"turns": 3}})
    group = Group(0, PromptSource(config.data, tokenizer, 1).prompts[0], samples=[])

    def model_turn(group, text):
        sample = group.samples[0] if group.samples else None
        tokens = ids(tokenizer, text) + [tokenizer.eos_token_id]
        if sample is None:
            group.samples = [Sample(tokens, [-0.25] * len(tokens), "stop", [Span(0, len(tokens), 0)])]
        else:
            sample.token_ids, sample.logprobs = sample.token_ids + tokens, sample.logprobs + [-0.25] * len(tokens)
            sample.finish_reason = "stop"

    first = episode_runner(config, tokenizer)
    model_turn(group, "one")
    first.turn_ended(group, 0, 96)
    resumed = copy.deepcopy(group)  # what a checkpoint taken now restores
    second = episode_runner(config, tokenizer)
    for runner, episode_group in ((first, group), (second, resumed)):
        for text in ("two", "three"):
            model_turn(episode_group, text)
            runner.turn_ended(episode_group, 0, 96)
    assert resumed.samples[0].token_ids == group.samples[0].token_ids
    assert resumed.samples[0].episode == group.samples[0].episode
    assert group.samples[0].episode.reward == 3.0 and group.samples[0].episode.done


def test_rewards_see_the_episode_and_the_environments_reward(tmp_path, tokenizer):
    config = make_config(tmp_path, [ADD_ROW], {"name": "tests.environment_fixtures.CountingEnvironment",
                                               "kwargs": {"turns": 2}})
    (group,), _ = produce(config, tokenizer, lambda text, sample: f"answer {sample}")
    kwargs = group_call(group, group.texts)
    assert kwargs["completions"][0] == [{"role": "assistant", "content": "answer 0"},
                                        {"role": "user", "content": "turn 1"},
                                        {"role": "assistant", "content": "answer 0"}]
    assert kwargs["environment_reward"] == [2.0, 2.0]
    assert environment_reward(**kwargs) == [2.0, 2.0]


def test_the_environment_tokens_come_after_the_models_eos():
    """A template whose assistant turns end with the EOS token (Qwen's <|im_end|>): the environment's
    tokens start right after it, where the model stopped (TRL's EOS-trimmed suffix)."""
    class EndsWithEos:
        eos_token_id = 9

        def apply_chat_template(self, messages, add_generation_prompt, return_dict, tools=None):
            ids = []
            for message in messages:
                ids += [1, len(message["content"]), 9, 10]  # header, content, EOS, newline
            return {"input_ids": ids + ([1] if add_generation_prompt else [])}

    config = Config.model_validate({"environment": {"name": "conversation"}})
    runner = EpisodeRunner(config, EndsWithEos(), factory=None, tools=[])
    assert runner.environment_tokens([{"role": "user", "content": "abc"}]) == [10, 1, 3, 9, 10, 1]


@pytest.mark.parametrize("environment, algo, message", [
    ({"name": "tools"}, {}, "environment.name = tools needs environment.tools"),
    ({"name": "conversation", "tools": [ADD]}, {}, "tools are called by the tools environment only"),
    ({"name": "conversation"}, {"name": "ebft"}, "environments train with algo.name = grpo"),
])
def test_the_config_refuses_an_environment_it_cannot_run(environment, algo, message):
    with pytest.raises(ValueError, match=message):
        Config.model_validate({"environment": environment, "algo": {"num_generations": 2, **algo}, "rewards": {}})


def test_an_unknown_tool_parser_is_named(tmp_path, tokenizer):
    from driver.cli import ConfigError

    config = make_config(tmp_path, [ADD_ROW], {"name": "tools", "tools": [ADD], "tool_parser": "no-such"})
    with pytest.raises(ConfigError, match="environment.tool_parser = 'no-such' is not one of vLLM's"):
        make_factory(config.environment, tokenizer)


def test_a_grammar_cannot_go_with_partial_rollouts():
    """A continued completion is a new request: its grammar would restart mid-completion (found with the
    tool-calling example, whose tool calls came back broken)."""
    with pytest.raises(ValueError, match="partial_rollout_tokens cannot go with rollout.sampling.structured_outputs"):
        Config.model_validate({"rollout": {"partial_rollout_tokens": 8,
                                           "sampling": {"structured_outputs": {"regex": "[0-9]+"}}}})


def test_the_toy_reward_credits_the_call_its_operands_and_the_answer():
    from driver.environments.toy import sum_reward

    def call(a, b):
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}

    episodes = [[call(2, 3), {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "5"}],
                [call(2, 9), {"role": "tool", "name": "add", "content": "11"}, {"role": "assistant", "content": "11"}],
                [{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "7"}]]
    assert sum_reward(episodes, a=[2] * 4, b=[3] * 4, answer=["5"] * 4) == [2.0, 0.75, 1.0, 0.0]
