"""vLLM as an OpenAI-compatible server: launched here on 127.0.0.1, or reached at rollout.server_url.

Every sync hot-loads the adapter under a new name (/v1/load_lora_adapter) and unloads those older
than the newest keep_versions (prefetched jobs may still sample with them); generation and the sync
probe go through /v1/completions with token-id prompts, so nothing is re-tokenized on the way and
the sampled token ids come back exactly ("token_id:123" strings).
"""

from __future__ import annotations

import atexit
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter

from driver.config import Config, SamplingConfig
from driver.engine.base import Completion, Request, RolloutError, generate_by_stream
from driver.engine.colocate import engine_kwargs, set_cpu_defaults

LOG_NAME = "vllm-server.log"  # in config.output_dir
LOG_TAIL_LINES = 30  # quoted in launch errors
HEALTH_POLL_S = 1.0
SHUTDOWN_GRACE_S = 20.0  # SIGTERM, then SIGKILL
# One request carries a whole group of long completions on a slow machine; a hung server still fails.
REQUEST_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 10.0  # best-effort cleanup on a server we only connected to
MAX_CONCURRENT_REQUESTS = 64  # per-prompt requests in flight; the server batches them
TOKEN_ID_PREFIX = "token_id:"  # how return_tokens_as_token_ids spells a token
MODE_CHECK_TEMPERATURE = 2.0  # hot, so most sampled tokens are not the likeliest one
MODE_CHECK_TOKENS = 16
MODE_CHECK_MIN_GAP = 0.5  # nats between the likeliest and the sampled token: far above bf16 noise
# The server fills every sampling field a request leaves out from the model's generation_config.json
# (Qwen2.5 ships repetition_penalty 1.05, for one), which would silently change the distribution we
# sample from; the colocated engine uses these neutral values, so every request states them.
NEUTRAL_SAMPLING = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0)


def server_sampling(sampling: SamplingConfig) -> dict:
    """The sampling fields of a /v1/completions request (vLLM's extra parameters beside OpenAI's), every
    penalty stated so that a server's own defaults cannot change the distribution sampled from."""
    body = {**NEUTRAL_SAMPLING, **sampling.engine_sampling()}
    if sampling.structured_outputs is not None:
        body["structured_outputs"] = dict(sampling.structured_outputs)
    return body


class ServerError(RolloutError):
    """The vLLM server failed to start or answered a request with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def cli_flags(kwargs: dict) -> list[str]:
    """vLLM engine keyword arguments as api_server flags: dtype="float32" -> --dtype float32."""
    flags = []
    for key, value in kwargs.items():
        name = key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif isinstance(value, (list, tuple)):
            flags += [f"--{name}", *map(str, value)]
        else:
            flags += [f"--{name}", str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LaunchedServer:
    """A vLLM server process we own, in its own session: a Ctrl-C in the terminal reaches the trainer
    only, which saves its checkpoint and then stops the server through close(). atexit stops it when
    the trainer dies of an exception instead."""

    def __init__(self, config: Config, model_dir: str) -> None:
        set_cpu_defaults()  # inherited by the server through the environment
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   *cli_flags(engine_kwargs(config, model_dir)), "--host", "127.0.0.1", "--port", str(port)]
        # Without the first flag the server has no /v1/load_lora_adapter route, without the second no
        # /collective_rpc, through which full fine-tuning reloads the weights (a development endpoint:
        # this server listens on 127.0.0.1 only); unbuffered output keeps the log current, so a crash's
        # last words are in it.
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
               "PYTHONUNBUFFERED": "1"}
        self.log_path = config.output_dir / LOG_NAME
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # appended: a resumed run keeps the crashed run's log
            self._log_start = log.tell()
            log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atexit.register(self.stop)
        try:
            self._wait_until_healthy(config.rollout.server_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"the vLLM server exited with code {self.process.returncode} before it was "
                                  f"ready.{self.log_excerpt()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerError(f"the vLLM server was not healthy after {timeout:g} s "
                                  f"(rollout.server_timeout).{self.log_excerpt()}")
            time.sleep(HEALTH_POLL_S)

    def log_excerpt(self) -> str:
        """The last lines this server wrote, for error messages."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                lines = log.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError as error:
            return f" (its log {self.log_path} is unreadable: {error})"
        return f" Last lines of {self.log_path}:\n" + "\n".join(lines)

    def exit_note(self) -> str:
        if self.process.poll() is None:
            return ""
        return f"\nThe launched vLLM server exited with code {self.process.returncode}.{self.log_excerpt()}"

    def stop(self) -> None:
        """SIGTERM to the server's whole process group (the API process and its engine core), SIGKILL
        to whatever is left after the grace period."""
        atexit.unregister(self.stop)
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the leader's exit does not end its children
        except ProcessLookupError:
            pass
        self.process.wait()


class ServerGenerator:
    def __init__(self, config: Config, model_dir: str) -> None:
        self.config = config
        self.adapter_version = 0
        self.keep_versions = 2
        # Full fine-tuning: each sync reloads every weight in place, so one version is served at a time.
        self.full_weights = self.serves_one_version = config.model.adapter == "none"
        self._adapter: str | None = None  # name of the adapter the server serves for us
        self._names: dict[int, str] = {}  # version -> adapter name, the newest keep_versions
        self._server: LaunchedServer | None = None
        self.sampling_body = server_sampling(config.rollout.sampling)
        self._session = requests.Session()
        self._session.mount("http://", HTTPAdapter(pool_maxsize=MAX_CONCURRENT_REQUESTS))
        self._session.mount("https://", HTTPAdapter(pool_maxsize=MAX_CONCURRENT_REQUESTS))
        if config.rollout.api_key:
            self._session.headers["Authorization"] = f"Bearer {config.rollout.api_key}"
        try:
            if config.rollout.server_url:
                # Accept the OpenAI-client spelling ".../v1" too: every path below starts with /v1.
                self.url = config.rollout.server_url.rstrip("/").removesuffix("/v1")
            else:
                self._server = LaunchedServer(config, model_dir)
                self.url = self._server.url
            self.base_model = self._base_model_name()
            self._check_processed_logprobs()
        except BaseException:
            self.close()
            raise

    def _base_model_name(self) -> str:
        models = self._request("GET", "/v1/models").json()["data"]
        bases = [model["id"] for model in models if not model.get("parent")]  # adapters name a parent
        if not bases:
            raise ServerError(f"the vLLM server at {self.url} lists no base model in /v1/models: {models}")
        return bases[0]

    def _check_processed_logprobs(self) -> None:
        """Refuse a server that reports sampling logprobs before temperature (vLLM's default
        --logprobs-mode raw_logprobs): importance ratios would be silently wrong. Sample at temperature
        T, rescore the same tokens with prompt logprobs (always raw): only processed logprobs show the
        gap between the likeliest and the sampled token shrunk by 1/T."""
        prompt = list(range(4))  # any ids exist in any vocabulary
        request = dict(model=self.base_model, prompt=prompt, max_tokens=MODE_CHECK_TOKENS, ignore_eos=True,
                       temperature=MODE_CHECK_TEMPERATURE, top_p=1.0, top_k=-1, logprobs=1, seed=0,
                       return_tokens_as_token_ids=True, **NEUTRAL_SAMPLING)
        sampled = self._request("POST", "/v1/completions", request).json()["choices"][0]["logprobs"]
        tokens = [int(token[len(TOKEN_ID_PREFIX):]) for token in sampled["tokens"]]
        request = dict(model=self.base_model, prompt=prompt + tokens, max_tokens=1, temperature=1.0, top_p=1.0,
                       top_k=-1, prompt_logprobs=1, **NEUTRAL_SAMPLING)
        rescored = self._request("POST", "/v1/completions", request).json()["choices"][0]["prompt_logprobs"]
        for token, reported, raw in zip(tokens, sampled["top_logprobs"], rescored[len(prompt):]):
            raw_gap = max(entry["logprob"] for entry in raw.values()) - raw[str(token)]["logprob"]
            if raw_gap < MODE_CHECK_MIN_GAP:
                continue  # (near) the likeliest token: no gap to compare
            ratio = (max(reported.values()) - reported[f"{TOKEN_ID_PREFIX}{token}"]) / raw_gap
            if abs(ratio - 1 / MODE_CHECK_TEMPERATURE) < abs(ratio - 1):
                return
            raise ServerError(
                f"the vLLM server at {self.url} reports sampling logprobs before temperature scaling (the gap "
                f"to the likeliest token shrank by {ratio:.3f} at temperature {MODE_CHECK_TEMPERATURE:g}, "
                f"expected {1 / MODE_CHECK_TEMPERATURE:g}); start it with --logprobs-mode processed_logprobs")
        # No sampled token far from the likeliest (a near-deterministic model): nothing to tell apart.

    def _request(self, method: str, path: str, payload: dict | None = None, allowed: tuple[int, ...] = (),
                 timeout: float = REQUEST_TIMEOUT_S) -> requests.Response:
        """One HTTP call; any failure other than the `allowed` statuses raises with the server's answer."""
        try:
            response = self._session.request(method, self.url + path, json=payload, timeout=timeout)
        except requests.RequestException as error:
            raise ServerError(f"{method} {path} to the vLLM server at {self.url} failed: {error}"
                              f"{self._exit_note()}") from error
        if not response.ok and response.status_code not in allowed:
            raise ServerError(f"{method} {path} -> HTTP {response.status_code}: {response.text}{self._exit_note()}",
                              response.status_code)
        return response

    def _exit_note(self) -> str:
        return self._server.exit_note() if self._server is not None else ""

    @property
    def served_model(self) -> str:
        return self._adapter or self.base_model

    def sync(self, adapter_dir: Path, version: int) -> None:
        if self.full_weights:
            self._reload_weights(adapter_dir, version)
            return
        # A fresh name per load: the server keys its adapter table and its prefix cache on the name
        # (and path), and a server we only connected to may still hold names from an earlier run.
        name = f"adapter-v{version}-{secrets.token_hex(4)}"
        path = str(Path(adapter_dir).resolve())
        try:
            self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerError as error:
            raise ServerError(f"loading adapter version {version} from {path} failed: {error}\nThe server must "
                              "run with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and be able to "
                              "read that directory.", error.status) from error
        self._adapter, self.adapter_version, self._names[version] = name, version, name
        for old in sorted(self._names)[:-self.keep_versions]:
            self._unload(self._names.pop(old))

    def _reload_weights(self, model_dir: Path, version: int) -> None:
        """Full fine-tuning: the server reloads every weight from model_dir in place (vLLM's
        reload_weights through /collective_rpc, a development endpoint), then drops its prefix cache,
        computed with the old weights."""
        path = str(Path(model_dir).resolve())
        try:
            self._request("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            self._request("POST", "/reset_prefix_cache")
        except ServerError as error:
            hint = (" The server has no /collective_rpc: start it with VLLM_SERVER_DEV_MODE=1 in its environment "
                    "(full fine-tuning reloads the weights through it)." if error.status == 404 else "")
            raise ServerError(f"reloading the weights of version {version} from {path} failed: {error}.{hint} It must "
                              "be able to read that directory.", error.status) from error
        self.adapter_version = version

    def _unload(self, name: str, timeout: float = REQUEST_TIMEOUT_S) -> None:
        # 404: already gone (e.g. unloaded by whoever runs the server); nothing left to free.
        self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name}, allowed=(404,), timeout=timeout)

    def generate(self, prompts: list[list[int]], n: int, seed: int) -> list[list[Completion]]:
        return generate_by_stream(self, prompts, n, seed, self.config.rollout.sampling.max_tokens)

    def stream(self, requests: list[Request], version: int) -> Iterator[tuple[int, list[Completion]]]:
        if not requests:
            return
        if self._names and version not in self._names:
            raise ServerError(f"adapter version {version} is not loaded (kept: {sorted(self._names)})")
        if self.full_weights and version != self.adapter_version:
            raise ServerError(f"the server serves the weights of version {self.adapter_version}, not {version}")
        common = {"model": self._names.get(version, self.base_model), "logprobs": 0,
                  "return_tokens_as_token_ids": True, **self.sampling_body}

        def complete(request: Request) -> list[Completion]:
            body = self._request("POST", "/v1/completions", {**common, "prompt": request.token_ids, "n": request.n,
                                                              "seed": request.seed, "max_tokens": request.max_tokens})
            return _completions(body.json(), request.n)

        with ThreadPoolExecutor(max_workers=min(len(requests), MAX_CONCURRENT_REQUESTS)) as pool:
            futures = {pool.submit(complete, request): index for index, request in enumerate(requests)}
            for future in as_completed(futures):
                yield futures[future], future.result()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        request = dict(model=self.served_model, prompt=token_ids, max_tokens=1, temperature=1.0, top_p=1.0,
                       top_k=-1, prompt_logprobs=0, **NEUTRAL_SAMPLING)
        entries = self._request("POST", "/v1/completions", request).json()["choices"][0]["prompt_logprobs"]
        if entries is None or len(entries) != len(token_ids):
            raise ServerError(f"prompt_logprobs: sent {len(token_ids)} tokens, the server scored "
                              f"{None if entries is None else len(entries)} positions")
        # Keys are token ids as JSON strings; position 0 has no prefix and is null.
        return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], token_ids[1:])]

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
        elif getattr(self, "url", None):
            # A server we only connected to keeps running; free the adapters we loaded into it.
            for name in self._names.values():
                try:
                    self._unload(name, timeout=CLOSE_TIMEOUT_S)
                except ServerError:
                    pass  # best effort: the server may be gone already
        self._adapter, self._names = None, {}
        self._session.close()


def _completions(body: dict, n: int) -> list[Completion]:
    choices = sorted(body["choices"], key=lambda choice: choice["index"])
    if len(choices) != n:
        raise ServerError(f"asked the server for {n} completions, got {len(choices)}")
    return [_completion(choice) for choice in choices]


def _completion(choice: dict) -> Completion:
    tokens, logprobs = choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
    if any(not token.startswith(TOKEN_ID_PREFIX) for token in tokens):
        raise ServerError(f"the server returned tokens as text ({tokens[:3]}...), not '{TOKEN_ID_PREFIX}<id>': "
                          "it ignores return_tokens_as_token_ids")
    token_ids = [int(token[len(TOKEN_ID_PREFIX):]) for token in tokens]
    return Completion(token_ids=token_ids, logprobs=[float(lp) for lp in logprobs],
                      finish_reason=choice["finish_reason"] or "length")
