"""environment.name = nemo_gym_agent: the config's refusals, and driver/rollouts/agent_runs.py against a stand-in
agent server (a local HTTP server with NeMo Gym's GET / and POST /run, scripted): what a /run carries, retries,
the head-server lookup, the version discipline, and the producer's rounds. tests/e2e/test_nemo_gym_agent_e2e.py
runs the real ng_run stack."""

from __future__ import annotations

import json

import pytest
import yaml

from driver.config import Config
from driver.data.prompts import Prompt
from driver.data.records import Group
from driver.engine.base import RolloutError
from driver.rollouts.agent_runs import AgentRuns
from driver.rollouts.producer import Producer
from tests.json_stand_in import ScriptedJSONServer

AGENT_ROLLOUT = {"backend": "server", "server_url": "http://127.0.0.1:1", "sampling": {
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 32}}
ROW = {"responses_create_params": {"input": [{"role": "user", "content": "sf?"}], "tools": [{"name": "w"}],
                                   "metadata": {"extra_body": '{"foo": 1}', "tag": "x"}, "temperature": None},
       "prompt": [{"role": "user", "content": "sf?"}], "expected": "cold", "unused": None}


def agent_config(url: str | None = None, **sections) -> Config:
    environment = {"name": "nemo_gym_agent", "nemo_gym": {"agent_url": url or "http://127.0.0.1:1", "retries": 1,
                                                          "retry_backoff": 0.01, "timeout": 2.0}}
    data = {"source": "toy:digits", "chat_template_kwargs": {"enable_thinking": False}}
    merged = {"model": {"adapter": "none"}, "rollout": AGENT_ROLLOUT, "environment": environment, "data": data,
              "algo": {"num_generations": 2}, **sections}
    return Config.model_validate(merged)


@pytest.mark.parametrize("sections, message", [
    ({"rollout": {"backend": "colocate"}}, "rollout.backend = colocate"),
    ({"model": {"adapter": "lora"}}, "rollout.weight_sync = merged"),
    ({"rollout": {**AGENT_ROLLOUT, "partial_rollout_tokens": 8}}, "partial_rollout_tokens"),
    ({"environment": {"name": "nemo_gym_agent"}}, "exactly one of"),
    ({"environment": {"name": "nemo_gym_agent", "nemo_gym": {"agent_url": "http://a", "resources_server": "r"}}},
     "got agent_url, resources_server"),
    ({"environment": {"name": "nemo_gym_agent", "nemo_gym": {"head_server_url": "http://h"}}}, "agent_name"),
    ({"environment": {"name": "conversation", "nemo_gym": {"agent_url": "http://a"}}}, "nemo_gym_agent environment"),
])
def test_config_refusals_name_the_keys(sections, message):
    with pytest.raises(ValueError, match=message):
        agent_config(**sections)


def test_merged_lora_weights_on_a_server_are_accepted():
    config = agent_config(model={"adapter": "lora"}, rollout={**AGENT_ROLLOUT, "weight_sync": "merged"})
    assert config.environment.nemo_gym.agent_url


def run_answer(body: dict, prompt=(1, 2, 3)) -> dict:
    """simple_agent's answer for one model call that wrote [7, 8]."""
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}],
            "prompt_token_ids": list(prompt), "generation_token_ids": ["7", "8"], "generation_log_probs": [-1, -2]}
    return {**body, "response": {"output": [item]}, "reward": 0.5}


def stand_in_agent(head_config: dict | None = None) -> ScriptedJSONServer:
    """POST /run answered by run_answer (or the next `script` entry); GET /global_config_dict_yaml: head_config
    as the head server gives it (YAML text in a JSON string), any other GET: {}."""
    return ScriptedJSONServer(run_answer, get=lambda path: yaml.safe_dump(head_config) if path.startswith("/global")
                              else {})


@pytest.fixture
def stand_in():
    server = stand_in_agent()
    yield server
    server.stop()


class OneVersionServer:
    """What AgentRuns reads of a ServerGenerator serving one set of weights."""
    serves_one_version, adapter_version, urls, base_model = True, 3, ["http://127.0.0.1:1"], "base"


def group(group_id: int = 0) -> Group:
    return Group(group_id, Prompt(7, "sf?", [99], columns=dict(ROW)), [])


def test_a_run_carries_the_row_and_our_sampling(stand_in):
    runs = AgentRuns(agent_config(stand_in.url), OneVersionServer())
    body = runs.run_body(ROW, seed=11)
    params = body["responses_create_params"]
    assert "prompt" not in body and "unused" not in body and body["expected"] == "cold"
    assert (params["temperature"], params["top_p"], params["max_output_tokens"]) == (0.7, 0.9, 32)
    assert params["tools"] == [{"name": "w"}] and params["metadata"]["tag"] == "x"
    extra = json.loads(params["metadata"]["extra_body"])
    assert extra["foo"] == 1 and extra["seed"] == 11 and extra["top_k"] == 5
    assert extra["repetition_penalty"] == 1.0 and "temperature" not in extra  # neutral penalties stated
    assert json.loads(params["metadata"]["chat_template_kwargs"]) == {"enable_thinking": False}


def test_play_makes_each_group_from_its_runs(stand_in):
    runs = AgentRuns(agent_config(stand_in.url), OneVersionServer())
    groups = list(runs.play([group(0), group(1)], version=3, seeds=[100, 200], group_size=2))
    assert sorted(g.group_id for g in groups) == [0, 1] and len(stand_in.requests) == 4
    assert all(g.prompt.token_ids == [1, 2, 3] for g in groups)  # the model server's rendering, not ours
    assert all(s.token_ids == [7, 8] and s.episode.reward == 0.5 and s.version == 3 for g in groups for s in g.samples)
    seeds = sorted(json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"]
                   for r in stand_in.requests)
    assert seeds == [100, 101, 200, 201]


def test_play_refuses_a_version_the_server_does_not_serve(stand_in):
    runs = AgentRuns(agent_config(stand_in.url), OneVersionServer())
    with pytest.raises(RolloutError, match="serve version 4.*serves version 3"):
        list(runs.play([group()], version=4, seeds=[0], group_size=2))
    assert not stand_in.requests


def test_episodes_of_one_row_must_start_from_one_prompt(stand_in):
    runs = AgentRuns(agent_config(stand_in.url), OneVersionServer())
    stand_in.script = [run_answer(ROW, prompt=(1, 2)), run_answer(ROW, prompt=(1, 3))]
    with pytest.raises(RolloutError, match="data row 7 started from 2 different prompts"):
        list(runs.play([group()], version=3, seeds=[0], group_size=2))


def test_busy_answers_are_retried_and_errors_name_the_agent(stand_in):
    runs = AgentRuns(agent_config(stand_in.url), OneVersionServer())
    stand_in.script = [503]
    assert len(list(runs.play([group()], version=3, seeds=[0], group_size=1))) == 1
    stand_in.script = [422]
    with pytest.raises(RolloutError, match=f"NeMo Gym agent server {stand_in.url}: POST /run answered HTTP 422"):
        list(runs.play([group()], version=3, seeds=[0], group_size=1))
    stand_in.script = [{"reward": "high"}]
    with pytest.raises(RolloutError, match="without a numeric reward"):
        list(runs.play([group()], version=3, seeds=[0], group_size=1))


def test_an_agent_that_is_down_fails_at_start_naming_it(stand_in):
    url = stand_in.url
    stand_in.stop()
    with pytest.raises(RolloutError, match=f"NeMo Gym agent server {url} did not answer GET / .*is it running"):
        AgentRuns(agent_config(url), OneVersionServer())


def test_the_agent_is_found_through_the_head_server(stand_in):
    head = stand_in_agent({"head_server": {"host": "127.0.0.1", "port": 1},
                         "weather_agent": {"responses_api_agents": {"simple_agent": {
                             "host": "127.0.0.1", "port": int(stand_in.url.rsplit(":", 1)[1])}}}})
    try:
        environment = {"name": "nemo_gym_agent",
                       "nemo_gym": {"head_server_url": head.url, "agent_name": "weather_agent"}}
        assert AgentRuns(agent_config(environment=environment), OneVersionServer()).url == stand_in.url
        environment["nemo_gym"]["agent_name"] = "other"
        with pytest.raises(RolloutError, match="runs no such agent server \\(its agents: weather_agent\\)"):
            AgentRuns(agent_config(environment=environment), OneVersionServer())
    finally:
        head.stop()


class Rows:
    def __init__(self) -> None:
        self.given = 0

    def next_batch(self, count: int) -> list[Prompt]:
        self.given += count
        return [Prompt(self.given, "sf?", [99], columns=dict(ROW)) for _ in range(count)]

    def epochs_drawn(self) -> float:
        return 0.0


class Decoder:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def test_the_producer_plays_a_job_through_the_agent(stand_in):
    config = agent_config(stand_in.url, train={"prompts_per_step": 3})
    finished = []
    producer = Producer(config, OneVersionServer(), Rows(), Decoder(), on_finished=finished.append,
                        agent=AgentRuns(config, OneVersionServer()))
    job = producer.produce(0, version=3)
    assert len(job.groups) == 3 and len(finished) == 3 and not producer.in_flight
    assert all(g.texts == ["7 8", "7 8"] and g.finished for g in job.groups)
    assert all(g.prompt.token_ids == [1, 2, 3] and g.prompt.text == "1 2 3" for g in job.groups)
    assert len(stand_in.requests) == 3 * 2
