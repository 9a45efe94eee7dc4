"""EBFT multi-turn rollouts (driver/ebft/multi_turn.py): later turns rolled out through the Producer's
extend_finished hook, and the features of whole conversations.

The engine is a fake (ChatEngine: no model; it answers each rendered ChatML conversation with its last
user turn quoted), so a test can read from a generated turn which conversation it answered; the
tokenizer and its chat template are the tiny Qwen2's. The conversations the fake receives and the
features' oracle are rendered by hand (ChatML), not by the code under test.
"""

import json

import pytest
import torch

from driver.cli import ConfigError
from driver.config import Config
from driver.data.prompts import PromptSource
from driver.data.records import Group, Sample, Span
from driver.data.tiny_model import resolve_model_path
from driver.ebft.multi_turn import MultiTurnRollout, check_multi_turn_rows, feature_sequences, turn_seed
from driver.ebft.structured import FeatureScorer, adaptive_max_tokens, completion_ids
from driver.engine.base import Completion, RolloutError
from driver.rollouts.producer import Producer
from tests.ebft_fixtures import policy_with_random_adapter

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# Two conversations with different later turns (2 and 1 exchanges after the first answer) and a single-turn one.
RIVER = [SYSTEM, user("Name a river."), assistant("The Nile."), user("Its length?"), assistant("About 6650 km."),
         user("Which countries?"), assistant("Eleven, among them Egypt and Sudan.")]
MOUNTAIN = [user("Name a mountain."), assistant("Everest."), user("Its height?"), assistant("8849 m.")]
LAKE = [user("Name a lake."), assistant("Baikal.")]
CONVERSATIONS = [RIVER, MOUNTAIN, LAKE]
NUM_GENERATIONS = 2
TURN_BUDGET_BASE = 1000  # turn_budget(tokens) = 1000 + tokens: a request's max_tokens names its turn's answer


def chatml(messages: list[dict], generation_prompt: bool) -> str:
    """ChatML by hand, what the tiny tokenizer's template writes (the oracle of every rendering here)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def reply(user_text: str, sample: int) -> str:
    return f"#{sample} re: {user_text}"


class ChatEngine:
    """A fake Generator: request -> n completions "re: <the conversation's last user turn> #<j>" + <|im_end|>,
    at most max_tokens of them ("length"; a request ending inside an answer continues it), yielded out of
    order; records each stream call as (version, requests).
    fail_on: the index of the call that raises; skip_on: the index of the call that leaves a request out."""

    def __init__(self, tokenizer, fail_on: int | None = None, skip_on: int | None = None) -> None:
        self.tokenizer, self.fail_on, self.skip_on = tokenizer, fail_on, skip_on
        self.calls: list[tuple[int, list]] = []
        self.end, self.start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
        self.header = len(ids(tokenizer, "<|im_start|>assistant\n"))

    def stream(self, requests, version):
        call = len(self.calls)
        self.calls.append((version, list(requests)))
        if call == self.fail_on:
            raise RuntimeError("engine down")
        answered = []
        for index, request in enumerate(requests):
            text = self.tokenizer.decode(request.token_ids)
            last_user = text.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            answer_start = len(request.token_ids) - request.token_ids[::-1].index(self.start) - 1 + self.header
            done = request.token_ids[answer_start:]
            completions = []
            for sample in range(request.n):
                # A continuation (n = 1) finishes the answer its first tokens ("#<j> ...") began.
                answering = int(self.tokenizer.decode(done)[1]) if done else sample
                target = ids(self.tokenizer, reply(last_user, answering)) + [self.end]
                tokens = target[len(done):][:request.max_tokens]
                reason = "stop" if len(done) + len(tokens) == len(target) else "length"
                completions.append(Completion(tokens, [-0.5] * len(tokens), reason))
            answered.append((index, completions))
        if call == self.skip_on:
            answered = answered[1:]
        yield from reversed(answered)


def make_config(tmp_path, partial: int | None = None, **ebft) -> Config:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return Config.model_validate({
        "algo": {"name": "ebft", "num_generations": NUM_GENERATIONS},
        "data": {"source": str(data), "shuffle": False, "transform": "driver.ebft.transforms.first_turn"},
        "train": {"prompts_per_step": len(CONVERSATIONS), "seed": 5},
        "rollout": {"verify_sync": False, "partial_rollout_tokens": partial, "sampling": {"max_tokens": 64}},
        "ebft": {"feature_layers": [0.5, 1.0], "embed_method": "completion_mean", **ebft}})


def rollout(config, tokenizer, engine, version=3, jobs=1):
    """Jobs through the Producer with the multi-turn hook; returns (the last job, what on_finished saw of each
    group finished: its row and each sample's (first turn, later turns))."""
    seen = {}

    def on_finished(group):  # the later turns must be there before scoring sees the group
        seen[group.group_id] = (group.prompt.index, [(tokenizer.decode(s.token_ids, skip_special_tokens=True),
                                                      s.later_turns) for s in group.samples])

    hook = MultiTurnRollout(config, tokenizer, lambda tokens: TURN_BUDGET_BASE + tokens)
    producer = Producer(config, engine, PromptSource(config.data, tokenizer, 0), tokenizer, on_finished=on_finished,
                        extend_finished=hook)
    for index in range(jobs):
        job = producer.produce(index, version=version)
    return job, seen


# -- the rollout --

@pytest.mark.parametrize("partial", [None, 3])
def test_each_sample_answers_its_own_rows_later_turns_after_its_own_first_turn(tmp_path, tokenizer, partial):
    """With 2 samples per prompt, axolotl's `remaining_turns[idx // num_generations]` on its per-sample
    column would give the mountain group the river's turns; here every group continues its own row.
    Partial rollouts: the first turns take several rounds, the later turns follow whole when a group is done."""
    config = make_config(tmp_path, partial=partial)
    engine = ChatEngine(tokenizer)
    job, seen = rollout(config, tokenizer, engine, jobs=2 if partial else 1)
    if partial:
        assert job.metrics["rollout/rounds"] > 1
        later_requests = [r for _, requests in engine.calls for r in requests if r.max_tokens > TURN_BUDGET_BASE]
        # Each later turn of each finished group generated once, when the group finished.
        turns = sum(len(later) for _, samples in seen.values() for _, later in samples)
        assert len({r.seed for r in later_requests}) == len(later_requests) == turns
    expected = {  # per row: each sample's (first turn, later turns)
        0: [(reply("Name a river.", j), (reply("Its length?", 0), reply("Which countries?", 0))) for j in range(2)],
        1: [(reply("Name a mountain.", j), (reply("Its height?", 0),)) for j in range(2)],
        2: [(reply("Name a lake.", j), ()) for j in range(2)]}
    assert {row for row, _ in seen.values()} == {0, 1, 2}
    assert all(samples == expected[row] for row, samples in seen.values())
    for group in job.groups:  # what the job hands on is what scoring saw
        assert [later for _, later in seen[group.group_id][1]] == [s.later_turns for s in group.samples]
    if not partial:  # one round: the river's 2 later turns and the mountain's 1, per sample
        assert job.metrics["ebft/multi_turn_turns"] == 3 * NUM_GENERATIONS
        assert job.metrics["time/ebft_multi_turn"] >= 0


def test_later_turns_are_one_engine_call_per_turn_with_the_conversation_so_far(tmp_path, tokenizer):
    config = make_config(tmp_path)
    engine = ChatEngine(tokenizer)
    job, _ = rollout(config, tokenizer, engine, version=3)
    assert [version for version, _ in engine.calls] == [3, 3, 3]  # the job's adapter version throughout
    first, turn_1, turn_2 = (requests for _, requests in engine.calls)
    assert [r.n for r in first] == [NUM_GENERATIONS] * 3
    # Turn 1: every sample of both multi-turn groups finished in this round, in one call; turn 2: the river's.
    river_1 = [RIVER[:2] + [assistant(reply("Name a river.", j)), RIVER[3]] for j in range(NUM_GENERATIONS)]
    mountain_1 = [MOUNTAIN[:1] + [assistant(reply("Name a mountain.", j)), MOUNTAIN[2]]
                  for j in range(NUM_GENERATIONS)]
    river_2 = [m + [assistant(reply("Its length?", 0)), RIVER[5]] for m in river_1]
    for requests, conversations in [(turn_1, river_1 + mountain_1), (turn_2, river_2)]:
        assert [r.token_ids for r in requests] == [ids(tokenizer, chatml(c, True)) for c in conversations]
        assert all(r.n == 1 for r in requests)
    budgets = [TURN_BUDGET_BASE + len(ids(tokenizer, answer)) for answer in
               ["About 6650 km.", "8849 m.", "Eleven, among them Egypt and Sudan."]]
    assert [r.max_tokens for r in turn_1] == [budgets[0]] * 2 + [budgets[1]] * 2
    assert [r.max_tokens for r in turn_2] == [budgets[2]] * 2
    river, mountain, _ = job.groups
    expected_seeds = ([turn_seed(5, river.group_id, j, 0) for j in range(2)]
                      + [turn_seed(5, mountain.group_id, j, 0) for j in range(2)]
                      + [turn_seed(5, river.group_id, j, 1) for j in range(2)])
    assert [r.seed for r in turn_1 + turn_2] == expected_seeds
    assert len(set(expected_seeds)) == len(expected_seeds)
    again = ChatEngine(tokenizer)
    rollout(make_config(tmp_path), tokenizer, again, version=3)
    assert again.calls == engine.calls  # deterministic: a prefetch thread and the loop generate the same


def test_the_turn_budget_of_a_run_is_ebfts_adaptive_budget_of_that_turns_answer(tmp_path, tokenizer):
    config = make_config(tmp_path, gt_length_multiplier=2.0, min_max_tokens=1)
    config.rollout.sampling.max_tokens = 200
    engine = ChatEngine(tokenizer)
    hook = MultiTurnRollout(config, tokenizer, lambda tokens: adaptive_max_tokens(tokens, config))
    Producer(config, engine, PromptSource(config.data, tokenizer, 0), tokenizer, extend_finished=hook).produce(0, 0)
    assert [r.max_tokens for r in engine.calls[2][1]] == [2 * len(ids(tokenizer, RIVER[-1]["content"]))] * 2


@pytest.mark.parametrize("fail_on, skip_on, message", [
    (1, None, r"later turn 1 of 4 conversations \(data rows \[0, 1\]\) with adapter version 3 failed: "
              r"RuntimeError: engine down"),
    (2, None, r"later turn 2 of 2 conversations \(data rows \[0\]\) .* failed: RuntimeError: engine down"),
    (None, 1, r"later turn 1 of 4 conversations .*: the engine returned no completion for 1 of them"),
])
def test_a_failed_engine_call_fails_the_run_instead_of_leaving_an_empty_turn(tmp_path, tokenizer, fail_on, skip_on,
                                                                            message):
    config = make_config(tmp_path)
    with pytest.raises(RolloutError, match=message):
        rollout(config, tokenizer, ChatEngine(tokenizer, fail_on=fail_on, skip_on=skip_on))


def test_rows_without_later_turns_generate_nothing_more(tmp_path, tokenizer):
    config = make_config(tmp_path)
    hook = MultiTurnRollout(config, tokenizer, lambda tokens: tokens)
    engine = ChatEngine(tokenizer)
    lake = PromptSource(config.data, tokenizer, 0).prompts[2]
    group = Group(0, lake, [Sample([1], [-0.1], "stop", [Span(0, 1, 0)])])
    assert hook(engine, [group], 0) == {} and engine.calls == []


# -- checks before the run --

def test_rows_with_later_turns_are_checked_before_the_run(tmp_path, tokenizer):
    config = make_config(tmp_path)
    prompts = PromptSource(config.data, tokenizer, 0)
    check_multi_turn_rows(config, prompts)
    strided = make_config(tmp_path, mode="strided")
    with pytest.raises(ConfigError, match="row 0 has later turns .* ebft.mode structured only"):
        check_multi_turn_rows(strided, prompts)
    prompts.prompts[1].columns["remaining_turns"] = [user("Why?")]
    with pytest.raises(ConfigError, match=r"row 1: remaining_turns must end with an assistant turn"):
        check_multi_turn_rows(config, prompts)
    prompts.prompts[1].columns["remaining_turns"] = MOUNTAIN[2:]
    prompts.prompts[1].messages = None  # a text prompt: nothing to continue as a conversation
    with pytest.raises(ConfigError, match="row 1 has later turns .* but its prompt is text"):
        check_multi_turn_rows(config, prompts)


# -- features --

def by_hand(tokenizer, prompt: list[dict], conversation: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt, completion) ids of a whole conversation: the completion is what follows the prompt's rendering."""
    prompt_ids, full = ids(tokenizer, chatml(prompt, True)), ids(tokenizer, chatml(conversation, False))
    assert full[:len(prompt_ids)] == prompt_ids
    return prompt_ids, full[len(prompt_ids):]


def sample_of(tokenizer, text: str, later_turns: tuple[str, ...]) -> Sample:
    tokens = ids(tokenizer, text) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return Sample(tokens, [-0.5] * len(tokens), "stop", [Span(0, len(tokens), 0)], later_turns=later_turns)


FIRST_TURNS = ["Nile, surely.", "Amazon."]
LATER_TURNS = [("Long.", "Many."), ("6650 km.", "Eleven.")]


def river_and_lake_groups(config, tokenizer) -> list[Group]:
    river, _, lake = PromptSource(config.data, tokenizer, 0).prompts
    river_samples = [sample_of(tokenizer, text, later) for text, later in zip(FIRST_TURNS, LATER_TURNS)]
    lake_samples = [sample_of(tokenizer, text, ()) for text in ["Baikal.", "Ontario, the deepest."]]
    return [Group(0, river, river_samples), Group(1, lake, lake_samples)]


def test_feature_sequences_render_whole_conversations_and_split_them_after_the_prompt(tmp_path, tokenizer):
    config = make_config(tmp_path)
    river = river_and_lake_groups(config, tokenizer)[0]
    sequences = feature_sequences(tokenizer, config.data, river, "The Nile.")
    expected = [by_hand(tokenizer, RIVER[:2], RIVER[:2] + [assistant(first), RIVER[3], assistant(later[0]), RIVER[5],
                                                          assistant(later[1])])
                for first, later in zip(FIRST_TURNS, LATER_TURNS)]
    assert sequences == expected + [by_hand(tokenizer, RIVER[:2], RIVER)]


def test_a_generation_prompt_unlike_a_finished_turn_splits_both_sides_at_their_common_prefix(tmp_path, tokenizer):
    """enable_thinking false: the generation prompt ends with an empty think block that a rendered assistant
    turn lacks; the completion starts after `<|im_start|>assistant\\n` on both sides."""
    config = make_config(tmp_path)
    config.data.chat_template_kwargs = {"enable_thinking": False}
    config.data.max_prompt_length = 4
    river = river_and_lake_groups(config, tokenizer)[0]
    prompt, completion = feature_sequences(tokenizer, config.data, river, "The Nile.")[-1]
    prompt_ids = ids(tokenizer, chatml(RIVER[:2], True))
    assert ids(tokenizer, chatml(RIVER[:2], True) + "<think>\n\n</think>\n\n")[:len(prompt_ids)] == prompt_ids
    assert prompt == prompt_ids[-4:]  # cut from the left, as data.py cuts prompts
    assert completion == ids(tokenizer, chatml(RIVER, False))[len(prompt_ids):]


def test_a_multi_turn_group_whose_turns_were_not_rolled_out_is_an_error(tmp_path, tokenizer):
    config = make_config(tmp_path)
    river = river_and_lake_groups(config, tokenizer)[0]
    river.samples[1].later_turns = ("Long.",)
    with pytest.raises(ValueError, match="group 0 sample 1 has 1 generated later turns, its data row 0 has 2"):
        feature_sequences(tokenizer, config.data, river, "The Nile.")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    config = make_config(tmp_path_factory.mktemp("policy"))
    config.lora.r = 4
    return policy_with_random_adapter(config, std=0.5)


def test_features_of_a_multi_turn_group_are_those_of_the_rendered_conversations(tmp_path, policy):
    """A multi-turn group (whole conversations rendered by hand) beside a single-turn group (the sampled ids
    as before), both through the scorer's own pooled_features as the oracle."""
    config = make_config(tmp_path)
    config.train.micro_batch_size = 3
    tokenizer = policy.tokenizer
    scorer = FeatureScorer(config, policy)
    river, lake = river_and_lake_groups(config, tokenizer)
    gen, gt = scorer.group_features([river, lake])
    sequences = [by_hand(tokenizer, RIVER[:2], RIVER[:2] + [assistant(first), RIVER[3], assistant(later[0]),
                                                           RIVER[5], assistant(later[1])])
                 for first, later in zip(FIRST_TURNS, LATER_TURNS)]
    sequences.append(by_hand(tokenizer, RIVER[:2], RIVER))
    eos = tokenizer.eos_token_id
    sequences += [(lake.prompt.token_ids, completion_ids(s.token_ids, eos)) for s in lake.samples]
    sequences.append((lake.prompt.token_ids, ids(tokenizer, "Baikal.")))
    oracle = scorer.pooled_features([p for p, _ in sequences], [c for _, c in sequences]).view(2, 3, -1)
    torch.testing.assert_close(gen, oracle[:, :2], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(gt, oracle[:, 2], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(gen[0, 0], gen[0, 1])  # the generated conversations differ, so do their features


# -- checkpoints --

def test_later_turns_survive_checkpoints_and_samples_of_older_ones_have_none(tmp_path, tokenizer):
    import dataclasses
    import pickle

    from driver.rollouts.replay import group_from_dict

    river = river_and_lake_groups(make_config(tmp_path), tokenizer)[0]
    assert group_from_dict(dataclasses.asdict(river)).samples[1].later_turns == LATER_TURNS[1]  # replay buffer
    old = pickle.loads(pickle.dumps(river.samples[0]))
    del old.__dict__["later_turns"]  # a sample pickled before the field existed
    assert pickle.loads(pickle.dumps(old)).later_turns == ()


def test_the_ebft_algorithm_gives_the_producer_its_budgets_and_the_multi_turn_rollout(tmp_path, policy):
    from driver.algorithms import algorithm

    config = make_config(tmp_path, gt_length_multiplier=2.0, min_max_tokens=1)
    config.rollout.sampling.max_tokens = 200
    tokenizer = policy.tokenizer
    scorer, hooks = algorithm(config).make_scorer(config, policy)
    river = river_and_lake_groups(config, tokenizer)[0]
    assert hooks.max_tokens(river.prompt) == 2 * len(ids(tokenizer, "The Nile."))
    engine = ChatEngine(tokenizer)
    metrics = hooks.extend_finished(engine, [river], 7)
    assert metrics["ebft/multi_turn_turns"] == 2 * len(river.samples)
    assert [version for version, _ in engine.calls] == [7, 7]
    assert [r.max_tokens for r in engine.calls[1][1]] == [2 * len(ids(tokenizer, RIVER[-1]["content"]))] * 2
    assert river.samples[0].later_turns == (reply("Its length?", 0), reply("Which countries?", 0))
    scorer.close()
