"""EBFT chat transforms (driver/ebft/transforms.py) against hand-written rows, and data.py's exploding
transforms and chat-message prompts against a hand-rendered chat template."""

import copy
import json
import re

import pytest

from driver.cli import ConfigError
from driver.config import DataConfig
from driver.data.prompts import PromptSource, load_rows
from driver.data.tiny_model import resolve_model_path
from driver.ebft.transforms import (all_turns, check_later_turns, first_turn, last_turn, last_turn_answer_only,
                                    strip_thinking)

SYSTEM = {"role": "system", "content": "You are terse."}
USER_1 = {"role": "user", "content": "Name a river."}
ASSISTANT_1 = {"role": "assistant", "content": "The Nile."}
USER_2 = {"role": "user", "content": "Its length?"}
ASSISTANT_2 = {"role": "assistant", "content": "About 6650 km."}
USER_3 = {"role": "user", "content": "Which countries?"}
ASSISTANT_3 = {"role": "assistant", "content": "<think>\nList them.\n</think>\n\nEleven, e.g. Egypt."}
CONVERSATION = {"id": 7, "source": "unit", "messages": [SYSTEM, USER_1, ASSISTANT_1, USER_2, ASSISTANT_2, USER_3,
                                                        ASSISTANT_3]}

FIRST = {"id": 7, "source": "unit", "prompt": [SYSTEM, USER_1], "ground_truth": "The Nile."}
SECOND = {"id": 7, "source": "unit", "prompt": [SYSTEM, USER_1, ASSISTANT_1, USER_2],
          "ground_truth": "About 6650 km."}
# first_turn keeps what follows its ground truth (axolotl's ebft_chat_multiturn.transform).
FIRST_WITH_LATER_TURNS = {**FIRST, "remaining_turns": [USER_2, ASSISTANT_2, USER_3, ASSISTANT_3]}
LAST = {"id": 7, "source": "unit", "prompt": [SYSTEM, USER_1, ASSISTANT_1, USER_2, ASSISTANT_2, USER_3],
        "ground_truth": "<think>\nList them.\n</think>\n\nEleven, e.g. Egypt."}

def chatml(messages: list[dict]) -> str:
    """ChatML rendered by hand with the generation prompt (Qwen's format, what the tiny tokenizer's template
    writes): the oracle for data.py's chat prompts."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny://qwen2"))
    assert tokenizer.chat_template is not None  # the tiny models ship one
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return str(path)


# --- transforms on one 3-turn conversation ---

def test_first_turn():
    assert first_turn(copy.deepcopy(CONVERSATION)) == FIRST_WITH_LATER_TURNS


def test_last_turn():
    assert last_turn(copy.deepcopy(CONVERSATION)) == LAST


def test_all_turns():
    assert all_turns(copy.deepcopy(CONVERSATION)) == [FIRST, SECOND, LAST]


def test_transforms_leave_the_input_alone_and_rows_share_no_messages():
    row = copy.deepcopy(CONVERSATION)
    rows = all_turns(row)
    assert row == CONVERSATION
    rows[0]["prompt"][0]["content"] = "changed"
    assert rows[1]["prompt"][0] == SYSTEM and row["messages"][0] == SYSTEM
    first = first_turn(row)
    first["remaining_turns"][0]["content"] = "changed"
    assert row == CONVERSATION


def test_without_system_message():
    row = {"messages": [USER_1, ASSISTANT_1]}
    assert last_turn(row) == {"prompt": [USER_1], "ground_truth": "The Nile."}
    assert first_turn(row) == {"prompt": [USER_1], "ground_truth": "The Nile.", "remaining_turns": []}


def test_first_turn_drops_a_final_user_turn_that_has_no_answer():
    row = {"messages": [USER_1, ASSISTANT_1, USER_2, ASSISTANT_2, USER_3]}
    assert first_turn(row)["remaining_turns"] == [USER_2, ASSISTANT_2]
    assert first_turn({"messages": [USER_1, ASSISTANT_1, USER_2]})["remaining_turns"] == []


@pytest.mark.parametrize("messages,message", [
    ([USER_1, ASSISTANT_1, ASSISTANT_2], r"messages\[2\] must be a user turn .* got \{'role': 'assistant'"),
    ([USER_1, ASSISTANT_1, USER_2, USER_3, ASSISTANT_2], r"messages\[3\] must be an assistant turn"),
    ([USER_1, ASSISTANT_1, SYSTEM, USER_2, ASSISTANT_2], r"messages\[2\] must be a user turn .* 'system'"),
])
def test_first_turn_needs_later_turns_that_alternate_user_and_assistant(messages, message):
    with pytest.raises(ValueError, match=message):
        first_turn({"messages": messages})


@pytest.mark.parametrize("ground_truth,answer", [
    ("<think>\nList them.\n</think>\n\nEleven, e.g. Egypt.", "Eleven, e.g. Egypt."),
    ("A <think>x</think> B <think>\ny\n</think>C", "A B C"),
    ("No reasoning here. ", "No reasoning here."),
    ("<think>only reasoning</think>", ""),
    ("unpaired </think> tag", "unpaired </think> tag"),
])
def test_strip_thinking(ground_truth, answer):
    assert strip_thinking({"id": 1, "ground_truth": ground_truth}) == {"id": 1, "ground_truth": answer}


def test_last_turn_answer_only():
    assert last_turn_answer_only(copy.deepcopy(CONVERSATION)) == {**LAST, "ground_truth": "Eleven, e.g. Egypt."}


# --- bad rows ---

@pytest.mark.parametrize("row,message", [
    ({"id": 1}, r"non-empty list of chat messages in 'messages', got no such column; columns are \['id'\]"),
    ({"messages": []}, r"non-empty list of chat messages in 'messages', got list"),
    ({"messages": "hi"}, r"non-empty list of chat messages in 'messages', got str"),
    ({"messages": [USER_1, "The Nile."]}, r"messages\[1\] must be a dict .* got 'The Nile.'"),
    ({"messages": [USER_1, {"role": "tool", "content": "x"}]}, r"messages\[1\] must be a dict with 'role' in "
                                                                r"system/user/assistant"),
    ({"messages": [USER_1, {"role": "assistant", "content": None}]}, r"messages\[1\] .* str 'content'"),
    ({"messages": [USER_1, {"role": "assistant"}]}, r"messages\[1\] .* got \{'role': 'assistant'\}"),
    ({"messages": [SYSTEM, USER_1], "id": 3}, r"no assistant turn .*\(roles: system, user\); columns are "
                                              r"\['id', 'messages'\]"),
    ({"messages": [SYSTEM, ASSISTANT_1]}, r"messages\[1\] is an assistant turn after system, not after a user"),
    ({"messages": [ASSISTANT_1, USER_1]}, r"messages\[0\] is an assistant turn after nothing"),
])
@pytest.mark.parametrize("transform", [first_turn, last_turn, all_turns])
def test_bad_rows_raise(transform, row, message):
    with pytest.raises(ValueError, match=message):
        transform(row)


def test_an_assistant_turn_after_an_assistant_turn():
    row = {"messages": [USER_1, ASSISTANT_1, ASSISTANT_2]}  # first_turn: see the test of its later turns
    for transform in (last_turn, all_turns):
        with pytest.raises(ValueError, match=r"messages\[2\] is an assistant turn after assistant"):
            transform(row)


@pytest.mark.parametrize("turns,message", [
    ("hi", r"remaining_turns must be a list of chat messages, got str"),
    ([USER_2], r"remaining_turns must end with an assistant turn .* at remaining_turns\[0\]"),
    ([ASSISTANT_2], r"remaining_turns\[0\] must be a user turn"),
    ([USER_2, {"role": "assistant", "content": 5}], r"remaining_turns\[1\] must be an assistant turn"),
    ([USER_2, ASSISTANT_2, "Why?"], r"remaining_turns\[2\] must be a user turn .* got 'Why\?'"),
])
def test_later_turns_given_as_a_column_are_checked_too(turns, message):
    with pytest.raises(ValueError, match=message):
        check_later_turns(turns)
    check_later_turns([USER_2, ASSISTANT_2, USER_3, ASSISTANT_3])
    check_later_turns([])


def test_strip_thinking_needs_a_ground_truth():
    with pytest.raises(ValueError, match=r"str 'ground_truth' column .* columns are \['messages'\]"):
        strip_thinking({"messages": []})


# --- data.py: exploding transforms ---

def test_all_turns_explodes_rows_in_order_through_load_rows(tmp_path):
    other = {"id": 8, "source": "unit", "messages": [USER_2, ASSISTANT_2]}
    source = write_jsonl(tmp_path / "chats.jsonl", [CONVERSATION, other])
    rows = load_rows(DataConfig(source=source, transform="driver.ebft.transforms.all_turns"))
    assert rows == [FIRST, SECOND, LAST, {"id": 8, "source": "unit", "prompt": [USER_2],
                                          "ground_truth": "About 6650 km."}]


def drop_odd_ids(row: dict) -> list[dict]:
    return [] if row["id"] % 2 else [{**row, "prompt": f"q{row['id']}"}]


def returns_text(row: dict) -> str:
    return "not a row"


def test_a_transform_returning_an_empty_list_drops_the_row(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"id": i} for i in range(5)])
    rows = load_rows(DataConfig(source=source, transform="tests.driver.ebft.test_ebft_transforms.drop_odd_ids"))
    assert rows == [{"id": 0, "prompt": "q0"}, {"id": 2, "prompt": "q2"}, {"id": 4, "prompt": "q4"}]


def test_a_transform_returning_no_rows_is_an_error(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [{"id": 1}])
    with pytest.raises(ConfigError, match="must return a dict or a list of dicts, got str for row 0"):
        load_rows(DataConfig(source=source, transform="tests.driver.ebft.test_ebft_transforms.returns_text"))


def test_a_bad_row_is_named_by_load_rows(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", [CONVERSATION, {"id": 9, "messages": [SYSTEM, USER_1]}])
    with pytest.raises(ConfigError, match=r"data.transform: driver.ebft.transforms.last_turn rejected row 1: "
                                          r"row has no assistant turn"):
        load_rows(DataConfig(source=source, transform="driver.ebft.transforms.last_turn"))


@pytest.mark.parametrize("prompt", [[], ["hi"], [{"role": "user"}], [{"role": "user", "content": 3}], 5])
def test_a_prompt_must_be_text_or_chat_messages(tmp_path, prompt):
    source = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, {"prompt": prompt}])
    with pytest.raises(ConfigError, match=r"1 rows \(first: row 1\) have no text column 'prompt' "
                                          r"\(it must hold text or a list of chat messages"):
        load_rows(DataConfig(source=source))


# --- data.py: chat-message prompts are rendered with the chat template ---

def test_chat_prompts_are_tokenized_with_the_chat_template(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "chats.jsonl", [CONVERSATION])
    config = DataConfig(source=source, transform="driver.ebft.transforms.all_turns", shuffle=False)
    prompts = PromptSource(config, tokenizer, seed=0).prompts
    assert [p.columns for p in prompts] == [FIRST, SECOND, LAST]  # every column, the messages included
    for prompt, row in zip(prompts, [FIRST, SECOND, LAST]):
        assert prompt.text == chatml(row["prompt"])
        assert prompt.token_ids == tokenizer(chatml(row["prompt"]), add_special_tokens=False).input_ids
        templated = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)
        assert prompt.token_ids == list(templated["input_ids"])
    assert prompts[0].token_ids[:1] == tokenizer.convert_tokens_to_ids(["<|im_start|>"])


def test_chat_prompts_ignore_data_chat_template_and_are_cut_from_the_left(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "chats.jsonl", [CONVERSATION])
    full = tokenizer(chatml(LAST["prompt"]), add_special_tokens=False).input_ids
    for chat_template in (False, True):
        config = DataConfig(source=source, transform="driver.ebft.transforms.last_turn", chat_template=chat_template,
                            max_prompt_length=5)
        [prompt] = PromptSource(config, tokenizer, seed=0).prompts
        assert prompt.token_ids == full[-5:] and prompt.text == chatml(LAST["prompt"])


def test_text_prompts_are_unchanged(tokenizer):
    [prompt, *_] = PromptSource(DataConfig(shuffle=False), tokenizer, seed=0).prompts
    row = load_rows(DataConfig())[0]
    assert prompt.text == row["prompt"] and prompt.columns == row
    assert prompt.token_ids == tokenizer(row["prompt"], add_special_tokens=False).input_ids


def test_text_prompts_with_data_chat_template_become_one_user_message(tokenizer):
    [prompt, *_] = PromptSource(DataConfig(shuffle=False, chat_template=True), tokenizer, seed=0).prompts
    message = [{"role": "user", "content": prompt.text}]
    assert prompt.text == load_rows(DataConfig())[0]["prompt"]
    assert prompt.token_ids == tokenizer(chatml(message), add_special_tokens=False).input_ids


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """Qwen3's enable_thinking switch: false writes the empty think block after the generation prompt."""
    config = DataConfig(source="toy:digits-chat", shuffle=False, chat_template_kwargs={"enable_thinking": False})
    [prompt, *_] = PromptSource(config, tokenizer, seed=0).prompts
    messages = load_rows(DataConfig(source="toy:digits-chat"))[0]["prompt"]
    assert prompt.messages == messages and prompt.text == chatml(messages) + "<think>\n\n</think>\n\n"
    assert prompt.token_ids == tokenizer(prompt.text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("source,chat_template,message", [
    ("toy:digits-chat", False, "row 0 is a conversation, which needs the chat template"),
    ("toy:digits", True, "row 0 needs (data.chat_template: true) the chat template"),
])
def test_a_tokenizer_without_a_chat_template_is_a_config_error(tokenizer, source, chat_template, message):
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ConfigError, match=re.escape(message) + ".*tokenizer has none"):
        PromptSource(DataConfig(source=source, chat_template=chat_template), bare, seed=0)
