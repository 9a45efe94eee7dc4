"""The ng_run config driver.rewards.nemo_gym_agent_server writes (the stack itself runs in
tests/e2e/test_nemo_gym_agent_e2e.py)."""

import pytest

from driver.rewards.nemo_gym_agent_server import AgentServers
from driver.rewards.nemo_gym_server import DEFAULT_VENV

pytestmark = pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "ng_run").is_file(),
                                reason=f"no NeMo Gym venv at {DEFAULT_VENV}: run `make nemo-gym`")


def test_the_agent_calls_the_policy_on_our_server_with_token_ids(tmp_path):
    servers = AgentServers("example_single_tool_call", ["http://127.0.0.1:8000/", "http://127.0.0.1:8001"], "base",
                           max_steps=3, work_dir=tmp_path)
    config = servers.ng_run_config()
    model = config["policy_model"]["responses_api_models"]["vllm_model"]
    assert model["base_url"] == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    assert model["model"] == "base" and model["return_token_id_information"] and model["api_key"] == "EMPTY"
    agent = config["example_single_tool_call_simple_agent"]["responses_api_agents"]["simple_agent"]
    assert agent["resources_server"] == {"type": "resources_servers", "name": "example_single_tool_call"}
    assert agent["model_server"]["name"] == "policy_model" and agent["max_steps"] == 3
    assert servers.url == f"http://127.0.0.1:{agent['port']}" != servers.resources_url
    ports = {model["port"], agent["port"], config["example_single_tool_call"]["resources_servers"][
        "example_single_tool_call"]["port"]}
    assert len(ports) == 3 and all(block["host"] == "127.0.0.1" for block in (model, agent))
