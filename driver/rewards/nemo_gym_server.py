"""Start one NeMo Gym resources server on 127.0.0.1, the way its users run one: NeMo Gym's `ng_run`,
from its own venv (`make nemo-gym`: Python 3.12, nemo-gym from PyPI), with a config naming only that
server, for the reward driver.rewards.nemo_gym.verify to talk to.

From the shell,

    python -m driver.rewards.nemo_gym_server equivalence_rule grading_rule=seq_match

prints the server's URL and serves until Ctrl-C. From Python (the tests), `with ResourcesServer(...)
as server:` gives `server.url`.

What it does for ng_run: the server's block from the package's own config (resources_servers/<name>/
configs/*.yaml: its entrypoint, domain and defaults), with the given options, a free port and no
agent or model server; `skip_venv_if_present` with the server's venv linked to ours, so ng_run
installs nothing (it would otherwise build a uv venv per server, from the network). ng_run also runs
its head server (another free port) and a local Ray cluster, as it always does. Everything it starts
shares one process group, which stop() interrupts (ng_run's Ctrl-C shutdown), then kills.

Servers whose requirements.txt lists more than nemo-gym need those packages in the venv first:
`.nemo-gym/venv/bin/pip install -r <its requirements.txt, less the nemo-gym line>`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from driver.rewards.nemo_gym import prompt_from_row, verify

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = ROOT / ".nemo-gym" / "venv"  # where `make nemo-gym` installs it
HOST = "127.0.0.1"
STOP_GRACE_SECONDS = 20.0  # ng_run's own shutdown waits up to 10 s per server


class NemoGymSetupError(RuntimeError):
    """No NeMo Gym venv, no such resources server, or the server did not start (its log says why)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def interruptible() -> None:
    """In ng_run's process: Ctrl-C is its shutdown, which it cannot run if it was started with SIGINT
    ignored (inherited, e.g. from a shell's background job: stop() would have to kill it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def resources_servers_dir(venv: Path) -> Path:
    """The installed package's resources_servers/ (one per server: app.py, configs/, data/)."""
    found = sorted(venv.glob("lib/python3*/site-packages/resources_servers"))
    if not (venv / "bin" / "ng_run").is_file() or not found:
        raise NemoGymSetupError(f"no NeMo Gym venv at {venv}: run `make nemo-gym` (or pass the venv holding nemo-gym)")
    return found[-1]


def server_block(server_dir: Path) -> dict:
    """The server's settings in the package's configs (the first config defining it, by file name)."""
    name = server_dir.name
    for path in sorted((server_dir / "configs").glob("*.yaml")):
        for value in (yaml.safe_load(path.read_text()) or {}).values():
            block = value.get("resources_servers", {}).get(name) if isinstance(value, dict) else None
            if isinstance(block, dict):
                return dict(block)
    raise NemoGymSetupError(f"no config in {server_dir / 'configs'} defines the resources server {name}")


class ResourcesServer:
    """One resources server, started by start() (or `with`), stopped by stop(); `url` once started.

    options: the server's config fields (e.g. {"grading_rule": "seq_match"}), over the package's.
    work_dir: ng_run's working directory (its config, its cache/ and results/, server.log).
    access_log: log every request, 200s included (NeMo Gym leaves them out), e.g. to count /verify calls."""

    def __init__(self, name: str, options: dict | None = None, venv: Path = DEFAULT_VENV, work_dir: Path | None = None,
                 port: int | None = None, access_log: bool = False, startup_timeout: float = 180.0) -> None:
        self.venv, self.name = Path(venv).absolute(), name  # ng_run runs in work_dir
        server_dir = resources_servers_dir(self.venv) / name
        if not (server_dir / "app.py").is_file():
            known = sorted(p.parent.name for p in server_dir.parent.glob("*/app.py"))
            raise NemoGymSetupError(f"no resources server {name!r} in {server_dir.parent}; there are: "
                                    f"{', '.join(known)}")
        self.block = {**server_block(server_dir), **(options or {}), "host": HOST, "port": port or free_port()}
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix=f"nemo-gym-{name}-"))
        self.log_path = self.work_dir / "server.log"
        self.url = f"http://{HOST}:{self.block['port']}"
        self.access_log, self.startup_timeout = access_log, startup_timeout
        self.process: subprocess.Popen | None = None

    def ng_run_config(self) -> dict:
        """ng_run's config: {instance name: {server type: {server directory: block}}}."""
        return {self.name: {"resources_servers": {self.name: self.block}}}

    def start(self) -> ResourcesServer:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.ng_run_config()
        config_path = self.work_dir / f"{self.name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        # ng_run looks for a server's venv at <uv_venv_dir>/<server type>/<server directory>/.venv
        venvs = self.work_dir / "venvs"
        for server_type, directory in {(kind, name) for instance in config.values()
                                       for kind, servers in instance.items() for name in servers}:
            linked = venvs / server_type / directory / ".venv"
            linked.parent.mkdir(parents=True, exist_ok=True)
            if not linked.exists():
                linked.symlink_to(self.venv.resolve(), target_is_directory=True)
        command = [str(self.venv / "bin" / "ng_run"), f"+config_paths=[{config_path}]", "+skip_venv_if_present=true",
                   f"+uv_venv_dir={venvs}", f"+head_server={{host: {HOST}, port: {free_port()}}}",
                   f"+uvicorn_logging_show_200_ok={str(self.access_log).lower()}"]
        # This venv's Python settings must not reach NeMo Gym's (another Python version).
        env = {key: value for key, value in os.environ.items()
               if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                            preexec_fn=interruptible)
        try:
            self._wait_until_live()
        except BaseException:
            self.stop()
            raise
        return self

    def live_urls(self) -> list[str]:
        """The servers that must answer before start() returns."""
        return [self.url]

    def _wait_until_live(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = self.live_urls()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NemoGymSetupError(f"ng_run exited ({self.process.returncode}) before the {self.name} servers "
                                        f"answered:\n{self.log_tail()}\n(whole log: {self.log_path})")
            try:
                with urllib.request.urlopen(waiting[0] + "/", timeout=5):
                    waiting.pop(0)
                if not waiting:
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise NemoGymSetupError(f"the {self.name} servers did not all answer ({', '.join(waiting)} did not) within "
                                f"{self.startup_timeout:g} s:\n{self.log_tail()}\n(whole log: {self.log_path})")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """Ctrl-C to ng_run and everything it started (its server, head server and Ray), then SIGKILL
        to whatever is left after STOP_GRACE_SECONDS."""
        if self.process is None:
            return
        process, self.process = self.process, None
        for sig, wait in ((signal.SIGINT, STOP_GRACE_SECONDS), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                if sig == signal.SIGINT:  # ng_run is done; its children get the same grace to finish
                    self._wait_for_group(process.pid, wait)
                break
            except subprocess.TimeoutExpired:
                continue

    @staticmethod
    def _wait_for_group(pgid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> ResourcesServer:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()


def dotted_path(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m driver.rewards.nemo_gym_server",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a resources server of the nemo-gym package, e.g. equivalence_rule")
    parser.add_argument("options", nargs="*", metavar="key=value", help="its config fields (values read as YAML)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"NeMo Gym's venv (default {DEFAULT_VENV})")
    parser.add_argument("--port", type=int, help="the server's port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--access-log", action="store_true", help="log every request (NeMo Gym leaves 200s out)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the server as Ctrl-C does
    options = {}
    for option in args.options:
        key, sep, value = option.partition("=")
        if not sep:
            parser.error(f"{option}: options are key=value")
        options[key] = yaml.safe_load(value)
    try:
        server = ResourcesServer(args.name, options, args.venv, port=args.port, access_log=args.access_log).start()
    except NemoGymSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    examples = resources_servers_dir(args.venv) / args.name / "data"
    print(f"NeMo Gym resources server {args.name} at {server.url} (log: {server.log_path}); Ctrl-C stops it.\n"
          f"Its reward: rewards.functions: [{{path: {dotted_path(verify)}, kwargs: {{url: {server.url}}}}}]\n"
          f"Its data (e.g. {examples}/*.jsonl): data.transform: {dotted_path(prompt_from_row)}", flush=True)
    try:
        while server.process.poll() is None:
            time.sleep(1)
        print(f"error: ng_run exited ({server.process.returncode}):\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
