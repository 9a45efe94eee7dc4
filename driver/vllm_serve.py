"""`python -m driver.vllm_serve cfg.yaml [--section.key=value ...] [--host H] [--port P]` (or
`pykernels-vllm-serve`): the vLLM server a run of cfg.yaml connects to, started on its own GPUs or
machine, like `trl vllm-serve` and `axolotl vllm-serve`.

It serves what the run would launch itself (driver/engine/launch.py): the config's model (under QLoRA
its NF4 round trip, driver/policy/nf4_base.py), the LoRA limits, the rollout section's engine options
(tensor and data parallel, dtype, quantization, ...) and processed logprobs, and prints the URL to
train with (rollout.server_url). It listens on --host / --port, else on the host and port of
rollout.server_url (one URL: the same file then configures both sides), else on 127.0.0.1:8000. The
server runs in the foreground, its output in this terminal; Ctrl-C stops it and exits with status 0.
An axolotl config works as with driver.train (translated first).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from urllib.parse import urlsplit

from driver.cli import ConfigError, exit_on_config_error, load_config, parse_args
from driver.config import Config
from driver.data.adapter_settings import adopt_adapter_settings
from driver.data.model_source import model_directory
from driver.engine import served_base_dir
from driver.engine.launch import ServerError, ServerProcess, server_command, server_env

USAGE = ("usage: python -m driver.vllm_serve [config.yaml] [--from axolotl] [--section.key=value ...] "
         "[--host HOST] [--port PORT]")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listen on every interface


def split_address_args(argv: list[str]) -> tuple[list[str], str | None, int | None]:
    """(the config's arguments, --host, --port): `--host H`, `--host=H`, `--port P`, `--port=P`."""
    rest, given = [], {}
    args = iter(argv)
    for arg in args:
        name, sep, value = arg.partition("=")
        if name in ("--host", "--port"):
            value = value if sep else next(args, None)
            if not value:
                raise ConfigError(f"{name} needs a value\n{USAGE}")
            given[name] = value
        else:
            rest.append(arg)
    port = given.get("--port")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"--port {port}: a port number (1-65535)")
    return rest, given.get("--host"), None if port is None else int(port)


def listen_address(config: Config, host: str | None, port: int | None) -> tuple[str, int]:
    """--host / --port, else rollout.server_url's, else 127.0.0.1:8000."""
    urls = config.rollout.server_urls()
    if len(urls) > 1 and (host is None or port is None):
        raise ConfigError(f"rollout.server_url lists {len(urls)} servers: start each with its own --host and --port")
    if urls:
        address = urlsplit(urls[0])
        host = host if host is not None else address.hostname
        port = port if port is not None else address.port or (443 if address.scheme == "https" else 80)
    return host if host is not None else DEFAULT_HOST, port if port is not None else DEFAULT_PORT


def served_merged(config, model_dir: str) -> bool:
    """Whether the training runs that connect to this server sync merged (or whole) weights into it:
    rollout.weight_sync as driver.engine.weight_sync_mode resolves it for a server and this model."""
    from transformers import AutoConfig

    from driver.engine import weight_sync_mode

    as_server = config.model_copy(deep=True)
    as_server.rollout.backend = "server"
    return weight_sync_mode(as_server, AutoConfig.from_pretrained(model_dir)) == "merged"


def main(argv: list[str] | None = None) -> int:
    try:
        rest, host, port = split_address_args(sys.argv[1:] if argv is None else argv)
        path, overrides, show_help, source_format = parse_args(rest)
        if show_help:
            print(__doc__ + "\n" + USAGE + "\nThe config's keys: python -m driver.train --help")
            return 0
        config = load_config(path, overrides, source_format)
        adopt_adapter_settings(config)  # lora.init_from's rank sizes the server's LoRA slots
        host, port = listen_address(config, host, port)
        model_dir = served_base_dir(config, model_directory(config.model.path, config.model.revision), launched=True)
        # Full fine-tuning and merged weights (as a training run connecting to a server resolves auto) reload the
        # weights through /collective_rpc, a development endpoint, and need no LoRA slots.
        full = served_merged(config, model_dir)
        command = server_command(config, model_dir, host, port, lora=not full)
    except ConfigError as error:
        exit_on_config_error(error)
    if full and host not in ("127.0.0.1", "localhost", "::1"):
        why = "model.adapter = none" if config.model.adapter == "none" else "rollout.weight_sync = merged"
        print(f"warning: {why}: the server runs with VLLM_SERVER_DEV_MODE=1 on {host}, and anyone "
              f"who reaches port {port} can call its development endpoints", file=sys.stderr, flush=True)
    local_url = f"http://{'127.0.0.1' if host in WILDCARD_HOSTS else host}:{port}"
    public_url = f"http://{socket.gethostname() if host in WILDCARD_HOSTS else host}:{port}"
    print(f"starting vLLM for {model_dir} on {host}:{port} (rollout.server_timeout = "
          f"{config.rollout.server_timeout:g} s to become healthy)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as Ctrl-C: stop the server, exit 0
    # Ctrl-C stops the server even when this process started with SIGINT ignored (Python then leaves it ignored:
    # a child of a background job, e.g. `nohup ... &`, where SIGINT sent to it did nothing and the server ran on).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # a run hides vLLM's log; a server's is its only output
    server = None
    try:
        server = ServerProcess(command, server_env(dev_mode=full), local_url, log_path=None,
                               timeout=config.rollout.server_timeout)
        print(f"vLLM serves {model_dir} at {public_url}\ntrain with: --rollout.backend=server "
              f"--rollout.server_url={public_url}  (Ctrl-C stops the server)", flush=True)
        code = server.process.wait()
        print(f"error: the vLLM server exited with code {code}", file=sys.stderr)
        return code or 1
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
