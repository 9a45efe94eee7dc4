"""Episodes played by a NeMo Gym agent server (environment.name: nemo_gym_agent): one POST /run per sample,
the row as NeMo Gym's dataset has it (`responses_create_params` and the verifier's fields) with our sampling
settings filled in; the answer is the whole episode, its model calls' token ids and logprobs, and the
resources server's reward (driver/environments/nemo_gym_episode.py makes it one training sequence).

The agent's model server calls our vLLM server by the base model's name at any moment of a /run, so that
server holds one set of weights, the current version's (full fine-tuning, or merged LoRA weights: the config
checks it), and the producer calls `play` inside the rollouts' engine lock with the version its job names: a
sync waits for every /run of an older version (driver/rollouts/feed.py), so no /run straddles a weight
reload, and play refuses a version the server does not serve.

Sampling: temperature, top_p and max_output_tokens (rollout.sampling.max_tokens, per model call) go in
responses_create_params; the rest (top_k, min_p, penalties stated neutral, stop, a per-episode seed) and
data.chat_template_kwargs in its metadata's `extra_body` / `chat_template_kwargs`, which vllm_model adds to
every chat completion request it makes for the episode.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from driver.config import Config
from driver.data.records import Group
from driver.engine.base import RolloutError
from driver.engine.server import server_sampling
from driver.environments.nemo_gym_episode import episode_from_run
from driver.rewards.nemo_gym import NemoGymRequestFailed, NemoGymUnavailable, json_request, without_nulls

ROOT = Path(__file__).resolve().parents[2]
AGENT = "NeMo Gym agent server"
HEAD = "NeMo Gym head server"
START_HINT = "environment.nemo_gym.resources_server starts one with the run"
RESPONSES_SAMPLING = ("temperature", "top_p")  # the sampling fields the Responses API itself has


def agent_runs(config: Config, generator) -> AgentRuns | None:
    """The run's agent when environment.name = nemo_gym_agent (None otherwise); started with ng_run when
    environment.nemo_gym.resources_server names one."""
    if config.environment.name != "nemo_gym_agent":
        return None
    return AgentRuns(config, generator)


class AgentRuns:
    def __init__(self, config: Config, generator) -> None:
        self.config, self.generator = config, generator
        agent = config.environment.nemo_gym
        self.timeout, self.retries, self.backoff = agent.timeout, agent.retries, agent.retry_backoff
        self.max_concurrency = agent.max_concurrency
        self.servers = None
        if agent.resources_server:
            self.url = self._start_servers(config, generator)
        elif agent.head_server_url:
            self.url = self._agent_url_from_head(agent.head_server_url.rstrip("/"), agent.agent_name)
        else:
            self.url = agent.agent_url.rstrip("/")
        try:
            self._request("GET", "/")  # NeMo Gym servers' liveness route: a server that is down fails now
        except RolloutError:
            self.close()
            raise
        sampling = config.rollout.sampling
        self.params = {"temperature": sampling.temperature, "top_p": sampling.top_p,
                       "max_output_tokens": sampling.max_tokens}
        self.extra_body = {key: value for key, value in server_sampling(sampling).items()
                           if key not in RESPONSES_SAMPLING and value is not None}
        self.template_kwargs = dict(config.data.chat_template_kwargs)

    def _start_servers(self, config: Config, generator) -> str:
        """ng_run with the resources server, policy_model on our vLLM server and simple_agent; the agent's URL.
        Stopped by close(), or at exit when the run fails before it has one to call."""
        from driver.rewards.nemo_gym_agent_server import AgentServers
        from driver.rewards.nemo_gym_server import NemoGymSetupError

        agent = config.environment.nemo_gym
        venv = Path(agent.venv).expanduser()
        venv = venv if venv.is_absolute() or venv.exists() else ROOT / venv
        try:
            self.servers = AgentServers(agent.resources_server, generator.urls, generator.base_model,
                                        agent.resources_server_options, max_steps=config.environment.max_turns,
                                        api_key=config.rollout.api_key, venv=venv,
                                        work_dir=Path(config.logging.output_dir) / "nemo-gym").start()
        except NemoGymSetupError as error:
            raise RolloutError(f"environment.nemo_gym.resources_server = {agent.resources_server}: {error}") from None
        atexit.register(self.close)
        return self.servers.url

    def _agent_url_from_head(self, head_url: str, name: str) -> str:
        """The agent's http://host:port from the head server's global config (NeMo Gym's own lookup)."""
        import yaml

        try:
            text = json_request(head_url, "GET", "/global_config_dict_yaml", None, self.timeout, self.retries,
                                self.backoff, server=HEAD, start_hint="ng_run starts one")
        except (NemoGymUnavailable, NemoGymRequestFailed) as error:
            raise RolloutError(str(error)) from None
        config = yaml.safe_load(text) if isinstance(text, str) else text
        agents = {key: next(iter(value["responses_api_agents"].values())) for key, value in (config or {}).items()
                  if isinstance(value, dict) and isinstance(value.get("responses_api_agents"), dict)}
        if name not in agents:
            raise RolloutError(f"environment.nemo_gym.agent_name = {name}: the ng_run at {head_url} runs no such agent "
                               f"server (its agents: {', '.join(sorted(agents)) or 'none'})")
        return f"http://{agents[name]['host']}:{agents[name]['port']}"

    def _request(self, method: str, path: str, body: dict | None = None):
        try:
            return json_request(self.url, method, path, body, self.timeout, self.retries, self.backoff,
                                server=AGENT, start_hint=START_HINT)
        except (NemoGymUnavailable, NemoGymRequestFailed) as error:
            raise RolloutError(str(error)) from None

    def run_body(self, row: dict, seed: int) -> dict:
        """The /run request of one episode: the row (its prompt column left out) with our sampling settings."""
        prompt_field = self.config.data.prompt_field
        params = row.get("responses_create_params") or {"input": row[prompt_field]}
        metadata = dict(params.get("metadata") or {})
        extra_body = {**json.loads(metadata.get("extra_body") or "{}"), **self.extra_body, "seed": seed}
        metadata["extra_body"] = json.dumps(extra_body)
        if self.template_kwargs:
            metadata["chat_template_kwargs"] = json.dumps({**json.loads(metadata.get("chat_template_kwargs") or "{}"),
                                                           **self.template_kwargs})
        params = {**params, **self.params, "metadata": metadata}
        return without_nulls({**{key: value for key, value in row.items() if key != prompt_field},
                              "responses_create_params": params})

    def play(self, groups: list[Group], version: int, seeds: list[int], group_size: int) -> Iterator[Group]:
        """Each group's group_size episodes, one /run each (at most max_concurrency at once); a group is
        yielded when its last episode is back, its prompt the token ids the episodes started from."""
        served = self.generator.adapter_version
        if not getattr(self.generator, "serves_one_version", False) or served != version:
            raise RolloutError(f"NeMo Gym /run episodes need the vLLM server to serve version {version}, one set of "
                               f"weights under the base model's name; it serves version {served}")
        max_tokens = self.config.rollout.sampling.max_tokens
        runs = {index: [None] * group_size for index in range(len(groups))}
        with ThreadPoolExecutor(min(self.max_concurrency, len(groups) * group_size or 1)) as pool:
            futures = {pool.submit(self._run, groups[index].prompt.columns, seeds[index] + sample): (index, sample)
                       for index in range(len(groups)) for sample in range(group_size)}
            for future in as_completed(futures):
                index, sample = futures[future]
                runs[index][sample] = episode_from_run(future.result(), version, max_tokens)
                if all(run is not None for run in runs[index]):
                    yield self._finish(groups[index], runs.pop(index))

    def _run(self, row: dict, seed: int) -> dict:
        answer = self._request("POST", "/run", self.run_body(row, seed))
        reward = answer.get("reward") if isinstance(answer, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RolloutError(f"{AGENT} {self.url}: /run answered without a numeric reward: {str(answer)[:300]}")
        return answer

    @staticmethod
    def _finish(group: Group, runs: list) -> Group:
        prompts = {tuple(run.prompt_ids) for run in runs if run.prompt_ids is not None}
        if len(prompts) > 1:
            raise RolloutError(f"the {len(runs)} /run episodes of data row {group.prompt.index} started from "
                               f"{len(prompts)} different prompts (token ids): the model server must render one row "
                               "one way")
        if prompts:  # the template the vLLM server rendered, tools included: what the trainer must score
            group.prompt = dataclasses.replace(group.prompt, token_ids=list(prompts.pop()))
        group.samples = [run.sample for run in runs]
        return group

    def close(self) -> None:
        servers, self.servers = self.servers, None
        if servers is not None:
            servers.stop()
