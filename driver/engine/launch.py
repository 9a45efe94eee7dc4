"""A vLLM OpenAI server process we own: the command line of the engine a run would start (the
colocated engine's arguments as flags, the LoRA and logprob settings included), its environment,
the wait until it is healthy, and its shutdown. A run launches one on 127.0.0.1 (`LaunchedServer`,
its log in output_dir); `python -m driver.vllm_serve` runs the same command in the foreground."""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from driver.config import Config
from driver.engine.base import RolloutError
from driver.engine.colocate import engine_kwargs, set_cpu_defaults
from driver.engine.server_worker import EXTENSION

LOG_NAME = "vllm-server.log"  # in config.output_dir
LOG_TAIL_LINES = 30  # quoted in launch errors
HEALTH_POLL_S = 1.0
SHUTDOWN_GRACE_S = 20.0  # SIGTERM, then SIGKILL
API_SERVER = "vllm.entrypoints.openai.api_server"


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


def server_command(config: Config, model_dir: str, host: str, port: int, lora: bool | None = None) -> list[str]:
    """The api_server command line of the engine the config describes, serving model_dir (lora: engine_kwargs')."""
    kwargs = engine_kwargs(config, model_dir, lora)
    if kwargs["data_parallel_size"] > 1:
        # One API process in front of the replicas: vLLM refuses runtime LoRA loading with several.
        kwargs["api_server_count"] = 1
    # Its reload re-arms the MoE experts' prepacking, which vLLM's own skips on CPU (server_worker.py).
    kwargs["worker_extension_cls"] = EXTENSION
    if config.environment.name == "nemo_gym_agent":
        # NeMo Gym's model server sends the rows' tools to /v1/chat/completions (tool_choice auto), which vLLM
        # answers only with a tool-call parser: it reads the calls out of the model's turns.
        kwargs.update(enable_auto_tool_choice=True, tool_call_parser=config.environment.tool_parser)
    return [sys.executable, "-m", API_SERVER, *cli_flags(kwargs), "--host", host, "--port", str(port)]


def server_env(dev_mode: bool) -> dict[str, str]:
    """The server's environment: runtime LoRA loading (the /v1/load_lora_adapter route), and with
    dev_mode VLLM_SERVER_DEV_MODE=1, whose /collective_rpc reloads the weights under full fine-tuning (a
    development endpoint: anyone who reaches the port may call it). Unbuffered output keeps a log
    current, so a crash's last words are in it."""
    set_cpu_defaults()  # inherited by the server through the environment
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "PYTHONUNBUFFERED": "1"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class ServerProcess:
    """A server process in its own session: a Ctrl-C in the terminal reaches only the process that
    started it, which stops the server through stop(). atexit stops it when that process dies of an
    exception instead. Its output goes to log_path (appended), or to this terminal when None."""

    def __init__(self, command: list[str], env: dict[str, str], url: str, log_path: Path | None,
                 timeout: float) -> None:
        self.url, self.log_path, self._log_start = url, log_path, 0
        if log_path is None:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:  # appended: a resumed run keeps the crashed run's log
                self._log_start = log.tell()
                log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(command)}\n".encode())
                log.flush()
                self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atexit.register(self.stop)
        try:
            self._wait_until_healthy(timeout)
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
        """The last lines this server wrote, for error messages (nothing when they went to the terminal)."""
        if self.log_path is None:
            return ""
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


class LaunchedServer(ServerProcess):
    """The server a run launches when rollout.server_url is empty: on 127.0.0.1 (so its development
    endpoints are this machine's only), a free port, its output in output_dir/vllm-server.log."""

    def __init__(self, config: Config, model_dir: str, lora: bool | None = None) -> None:
        port = free_port()
        super().__init__(server_command(config, model_dir, "127.0.0.1", port, lora), server_env(dev_mode=True),
                         f"http://127.0.0.1:{port}", config.output_dir / LOG_NAME, config.rollout.server_timeout)
