"""Start NeMo Gym's multi-turn stack on 127.0.0.1 with one `ng_run`, as axolotl's users run it by hand: a
resources server of the nemo-gym package (its tools and /verify), `policy_model` (responses_api_models/
vllm_model, calling our vLLM server at <url>/v1 by the served model's name, with return_token_id_information:
every model call's prompt and generation token ids and logprobs come back in the episode), and `simple_agent`
(responses_api_agents/simple_agent: generate, run the tool calls on the resources server, feed the results
back, until the model answers or max_steps; POST /run plays one episode and returns /verify's reward).

The same set-up as driver/rewards/nemo_gym_server.py (NeMo Gym's venv, skip_venv_if_present, free ports, one
process group stopped with Ctrl-C): `with AgentServers(...) as agent:` gives `agent.url`, the agent server's.
The training run starts one for environment.nemo_gym.resources_server (driver/rollouts/agent_runs.py).

vllm_model reads the conversation's reasoning out of <think> tags only with uses_reasoning_parser, which needs
a vLLM reasoning parser on our server: off, the model's turns go back to the template as it wrote them.
"""

from __future__ import annotations

from pathlib import Path

from driver.rewards.nemo_gym_server import DEFAULT_VENV, HOST, ResourcesServer, free_port

MODEL_SERVER = "policy_model"  # the name simple_agent's package config gives its model server


class AgentServers(ResourcesServer):
    """ng_run with the resources server `name`, policy_model on the vLLM servers at `policy_urls` (serving
    `model`) and simple_agent (at `url`). max_steps: simple_agent's model calls per episode at most."""

    def __init__(self, name: str, policy_urls: list[str], model: str, options: dict | None = None,
                 max_steps: int | None = None, api_key: str | None = None,
                 venv: Path = DEFAULT_VENV, work_dir: Path | None = None, startup_timeout: float = 300.0) -> None:
        super().__init__(name, options, venv, work_dir=work_dir, startup_timeout=startup_timeout)
        self.resources_url = self.url
        self.agent_name = f"{name}_simple_agent"
        self.model_block = {
            "entrypoint": "app.py", "host": HOST, "port": free_port(),
            "base_url": [url.rstrip("/") + "/v1" for url in policy_urls], "api_key": api_key or "EMPTY",
            "model": model, "return_token_id_information": True, "uses_reasoning_parser": False}
        self.agent_block = {
            "entrypoint": "app.py", "host": HOST, "port": free_port(), "max_steps": max_steps,
            "resources_server": {"type": "resources_servers", "name": name},
            "model_server": {"type": "responses_api_models", "name": MODEL_SERVER}}
        self.url = f"http://{HOST}:{self.agent_block['port']}"

    def ng_run_config(self) -> dict:
        return {**super().ng_run_config(),
                MODEL_SERVER: {"responses_api_models": {"vllm_model": self.model_block}},
                self.agent_name: {"responses_api_agents": {"simple_agent": self.agent_block}}}

    def live_urls(self) -> list[str]:
        model_url = f"http://{HOST}:{self.model_block['port']}"
        return [self.resources_url, model_url, self.url]
