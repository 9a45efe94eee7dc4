"""driver.rewards.nemo_gym against a stand-in for a NeMo Gym resources server: a local HTTP server
with NeMo Gym's routes (GET / liveness, POST /verify answering the request with a `reward`), scripted
to be slow, busy, broken or down. It checks what we send and how we retry, not NeMo Gym's verifiers:
tests/e2e/test_nemo_gym_e2e.py trains against a real resources server.
"""

from __future__ import annotations

import json
import pickle
import socket

import pytest

from driver.cli import ConfigError, config_from_argv, reward_function
from driver.config import DataConfig, RewardsConfig
from driver.data.prompts import load_rows
from driver.data.trainer_state import TrainerState
from driver.rewards import nemo_gym
from driver.rewards.functions import RewardFunctions
from tests.json_stand_in import ScriptedJSONServer

FAST = {"timeout": 2.0, "backoff": 0.01}  # retries without the real waits


def verify_answer(body: dict) -> dict:
    """The stand-in resources server's /verify: reward = len(the response's output_text) / 10."""
    text = body["response"]["output"][0]["content"][0]["text"]
    return {**body, "reward": len(text) / 10}


@pytest.fixture
def stand_in():
    server = ScriptedJSONServer(verify_answer)
    yield server
    server.stop()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


ROW = {"responses_create_params": {"input": [{"role": "user", "content": "2 + 2?"}], "temperature": None},
       "expected_answer": "4", "options": None}


def columns(rows: list[dict]) -> dict:
    return {key: [row.get(key) for row in rows] for key in rows[0]}


# --- data --------------------------------------------------------------------------------------------

def test_prompt_from_row_makes_the_input_messages_the_prompt_and_keeps_the_row():
    row = nemo_gym.prompt_from_row({**ROW, "responses_create_params": {
        "instructions": "Be brief.",
        "input": [{"role": "developer", "content": "Answer with a number.", "type": "message"},
                  {"role": "user", "content": [{"type": "input_text", "text": "2 + "},
                                               {"type": "input_text", "text": "2?"}]}]}})
    assert row["prompt"] == [{"role": "system", "content": "Be brief."},
                             {"role": "system", "content": "Answer with a number."},
                             {"role": "user", "content": "2 + 2?"}]
    assert row["expected_answer"] == "4" and "responses_create_params" in row
    text_input = nemo_gym.prompt_from_row({"responses_create_params": {"input": "Hi"}})
    assert text_input["prompt"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("row, message", [
    ({"question": "2 + 2?"}, "no responses_create_params.input"),
    ({"responses_create_params": {"input": [{"type": "function_call_output", "call_id": "1", "output": "4"}]}},
     "'function_call_output' item"),
    ({"responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}},
     "input_image content"),
])
def test_prompt_from_row_refuses_what_single_turn_verify_cannot_send(row, message):
    with pytest.raises(ValueError, match=message):
        nemo_gym.prompt_from_row(row)


def test_a_nemo_gym_jsonl_file_loads_as_chat_prompts(tmp_path):
    """Through `datasets`, as data.source: the prompt has role and content only, the verifier's fields
    stay, a field of one row is in every row (null where it was absent)."""
    path = tmp_path / "rows.jsonl"
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": "2 + 2?", "type": "message"}]},
             "expected_answer": "4", "options": [{"A": "4"}, {"B": "5"}]},
            {"responses_create_params": {"input": [{"role": "system", "content": "Digits."},
                                                   {"role": "user", "content": "3 + 3?"}], "temperature": 0.5},
             "expected_answer": "6"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_rows(DataConfig(source=str(path), transform="driver.rewards.nemo_gym.prompt_from_row"))
    assert [row["prompt"] for row in loaded] == [
        [{"role": "user", "content": "2 + 2?"}],
        [{"role": "system", "content": "Digits."}, {"role": "user", "content": "3 + 3?"}]]
    assert [row["expected_answer"] for row in loaded] == ["4", "6"]
    assert loaded[1]["options"] is None  # never sent (the request test)


# --- the request ------------------------------------------------------------------------------------

def test_the_request_carries_the_row_without_nulls_and_the_completion_as_a_responses_api_response(stand_in):
    reward = nemo_gym.verify(stand_in.url, model="tiny", **FAST)
    chat_completion = [{"role": "assistant", "content": "four"}]
    # As the driver calls it: TRL's trainer_state beside the row's columns, which is no field of the row.
    assert reward(["2 + 2?"], [chat_completion], [[1, 2]], trainer_state=TrainerState(global_step=3),
                  **columns([ROW])) == [0.4]
    (body,) = stand_in.requests
    assert body["responses_create_params"] == {"input": [{"role": "user", "content": "2 + 2?"}]}
    assert body["expected_answer"] == "4" and "options" not in body and "trainer_state" not in body
    response = body["response"]
    assert response["object"] == "response" and response["model"] == "tiny" and response["status"] == "completed"
    (message,) = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "output_text", "text": "four", "annotations": []}]


def test_a_row_without_create_params_sends_its_prompt_as_the_input(stand_in):
    reward = nemo_gym.verify(stand_in.url, **FAST)
    reward(["2 + 2?"], ["4"], [[1]], expected_answer=["4"])
    assert stand_in.requests[0]["responses_create_params"] == {"input": [{"role": "user", "content": "2 + 2?"}]}


def test_rewards_come_back_in_completion_order_with_requests_in_flight_capped(stand_in):
    stand_in.delay = 0.05
    reward = nemo_gym.verify(stand_in.url, max_concurrency=3, **FAST)
    completions = ["x" * n for n in range(1, 9)]
    assert reward(["q"] * 8, completions, [[1]] * 8, **columns([ROW] * 8)) == pytest.approx(
        [n / 10 for n in range(1, 9)])
    assert 1 < stand_in.most_in_flight <= 3


def test_the_reward_is_a_picklable_callable_named_as_axolotls(stand_in):
    reward = pickle.loads(pickle.dumps(nemo_gym.verify(stand_in.url, **FAST)))
    assert reward.__name__ == "reward_nemo_gym_verify"
    assert reward(["q"], ["ab"], [[1]], **columns([ROW])) == [0.2]


def test_the_driver_scores_through_the_factory_in_its_config(stand_in):
    config = RewardsConfig(functions=[{"path": "driver.rewards.nemo_gym.verify", "kwargs": {"url": stand_in.url}}])
    functions = RewardFunctions(config)
    table = functions(["q", "q"], ["abc", "a"], [ROW, ROW], [[1], [2]])
    assert functions.names == ["reward_nemo_gym_verify"]
    assert table[:, 0].tolist() == pytest.approx([0.3, 0.1])


# --- failures ---------------------------------------------------------------------------------------

def test_busy_answers_and_dropped_connections_are_retried(stand_in):
    stand_in.script = [503, "drop", 429]
    reward = nemo_gym.verify(stand_in.url, retries=3, **FAST)
    assert reward(["q"], ["abcd"], [[1]], **columns([ROW])) == [0.4]
    assert len(stand_in.requests) == 4


def test_an_error_answer_is_not_retried_and_names_the_server(stand_in):
    stand_in.script = [422]
    reward = nemo_gym.verify(stand_in.url, **FAST)
    with pytest.raises(nemo_gym.NemoGymRequestFailed, match=f"{stand_in.url}: POST /verify answered HTTP 422: "
                                                            ".*scripted 422"):
        reward(["q"], ["a"], [[1]], **columns([ROW]))
    assert len(stand_in.requests) == 1


def test_an_answer_without_a_reward_is_an_error(stand_in):
    stand_in.script = [{"detail": "no reward here"}]
    reward = nemo_gym.verify(stand_in.url, **FAST)
    with pytest.raises(nemo_gym.NemoGymRequestFailed, match="without a numeric reward"):
        reward(["q"], ["a"], [[1]], **columns([ROW]))


def test_a_server_that_stays_busy_or_slow_fails_after_the_retries(stand_in):
    reward = nemo_gym.verify(stand_in.url, retries=2, timeout=0.2, backoff=0.01)
    stand_in.script = [503, 503, 503]
    with pytest.raises(nemo_gym.NemoGymUnavailable, match=rf"{stand_in.url} did not answer POST /verify \(3 tries.*"
                                                          "HTTP 503.*is it running"):
        reward(["q"], ["a"], [[1]], **columns([ROW]))
    stand_in.delay = 0.5
    with pytest.raises(nemo_gym.NemoGymUnavailable, match="timed out"):
        reward(["q"], ["a"], [[1]], **columns([ROW]))


def test_a_server_that_went_down_is_named(stand_in):
    reward = nemo_gym.verify(stand_in.url, retries=1, **FAST)
    stand_in.stop()
    with pytest.raises(nemo_gym.NemoGymUnavailable, match=rf"{stand_in.url} did not answer POST /verify.*refused"):
        reward(["q"], ["a"], [[1]], **columns([ROW]))


def test_a_server_that_is_down_at_start_up_is_a_config_error_naming_it():
    """Found when the config is read (`python -m driver.train` prints it and exits 2), before any engine."""
    url = closed_port_url()
    with pytest.raises(ConfigError, match=rf"rewards.functions\[0\].path: .*{url} did not answer GET / .*"
                                          "refused.*driver.rewards.nemo_gym_server") as raised:
        config_from_argv([f"--rewards.functions=[{{path: driver.rewards.nemo_gym.verify, kwargs: {{url: {url}, "
                          "retries: 0}}]"])
    assert "Traceback" not in str(raised.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"url": "localhost:8000"}, "http://host:port"),
    ({"url": "http://127.0.0.1:1", "retries": -1}, "retries >= 0"),
    ({"url": "http://127.0.0.1:1", "max_concurrency": 0}, "max_concurrency"),
])
def test_bad_arguments_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        reward_function("driver.rewards.nemo_gym.verify", kwargs, "rewards.functions[0].path")
