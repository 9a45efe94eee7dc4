"""Server mode's robustness and data parallelism (driver/engine/server_client.py, server.py): per-request
timeouts, retries with exponential backoff, errors naming the server after the last retry, several
servers behind one client (round-robin, whole requests, every sync and probe on each).

The servers here are stand-ins: a small local http.server speaking the few routes of vLLM's OpenAI
server the driver calls (/v1/models, /v1/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter),
answering with vLLM's shapes and status codes, and recording every request it receives: the tests
assert on what the servers saw, and on failures the stand-ins inject (503, 400, silence, a closed
port). That a real vLLM server answers these routes this way is checked in test_driver_server.py and
end to end in tests/e2e/test_vllm_serve_e2e.py.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from driver.config import Config
from driver.engine.base import Request, SyncError
from driver.engine.launch import ServerError, free_port
from driver.engine.server import ServerGenerator
from driver.engine.server_client import ServerClient
from driver.engine.sync_check import SyncVerifier

BASE = "stand-in-base"
TOKEN = 7  # every sampled token
PROBE = [1, 2, 3, 4, 5, 6, 8, 9]


class StandIn(ThreadingHTTPServer):
    """One stand-in vLLM server on 127.0.0.1. `failures` is a queue of what the next requests get instead of
    an answer: an HTTP status, or "silence" (the answer comes after `silence_s`, too late for the client)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.seen: list[tuple[str, dict, dict]] = []  # (path, JSON body, headers) of every request
        self.failures: list[int | str] = []
        self.fail_paths: tuple[str, ...] = ("/v1/completions", "/v1/load_lora_adapter")
        self.silence_s = 0.0
        self.adapters: set[str] = set()
        self.probe_shift = 0.0  # added to every prompt logprob: a server serving other weights
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def requests_to(self, path: str, kind: str | None = None) -> list[dict]:
        """Bodies of the requests to path; kind: 'generation' or 'probe' among /v1/completions."""
        bodies = [body for seen_path, body, _ in self.seen if seen_path == path]
        if kind == "generation":
            # (the logprobs-mode check at start samples with ignore_eos)
            return [body for body in bodies if "prompt_logprobs" not in body and not body.get("ignore_eos")]
        if kind == "probe":
            return [body for body in bodies if body.get("prompt_logprobs") == 0]
        return bodies


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.server.seen.append((self.path, {}, dict(self.headers)))
        if self.path == "/v1/models":
            models = [{"id": BASE, "parent": None}, *({"id": name, "parent": BASE} for name in self.server.adapters)]
            self.answer(200, {"data": models})
        else:
            self.answer(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        server = self.server
        with server.lock:
            server.seen.append((self.path, body, dict(self.headers)))
            failure = server.failures.pop(0) if server.failures and self.path in server.fail_paths else None
        if failure == "silence":
            time.sleep(server.silence_s)  # the request still takes effect, the client has given up
        elif failure is not None:
            self.answer(failure, {"error": f"injected {failure}"})
            return
        if self.path == "/v1/completions":
            self.answer(200, self.completion(body))
        elif self.path == "/v1/load_lora_adapter":
            if body["lora_name"] in server.adapters:  # vLLM's words and status
                self.answer(400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has already been "
                                                       "loaded.", "code": 400}})
                return
            server.adapters.add(body["lora_name"])
            self.answer(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        elif self.path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in server.adapters:
                self.answer(404, {"error": "not loaded"})
                return
            server.adapters.discard(body["lora_name"])
            self.answer(200, "Success")
        else:
            self.answer(404, {"error": "not found"})

    def completion(self, body: dict) -> dict:
        if body.get("prompt_logprobs") is not None:  # scoring: position 0 has no prefix
            entries = [None] + [{str(token): {"logprob": -1.0 - 0.01 * token + self.server.probe_shift}}
                                for token in body["prompt"][1:]]
            return {"choices": [{"index": 0, "prompt_logprobs": entries}]}
        tokens = [f"token_id:{TOKEN}"] * body["max_tokens"]
        logprobs = {"tokens": tokens, "token_logprobs": [-0.5] * len(tokens),
                    "top_logprobs": [{token: -0.5} for token in tokens]}  # the likeliest token: no gap to check
        return {"choices": [{"index": index, "logprobs": logprobs, "finish_reason": "length"}
                            for index in range(body.get("n", 1))]}

    def answer(self, status: int, payload) -> None:
        data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass


@pytest.fixture
def servers():
    started = [StandIn(), StandIn()]
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def make_config(urls, **rollout) -> Config:
    config = Config()
    config.rollout.backend = "server"
    config.rollout.server_url = urls
    config.rollout.retry_backoff = 0.0
    for key, value in rollout.items():
        setattr(config.rollout, key, value)
    return config


def served(generator: ServerGenerator) -> str:
    """The model name requests give now: the newest adapter, or the base."""
    return generator.model_name(generator.url, generator.adapter_version)


def client_for(url: str, sleeps: list[float], **rollout) -> ServerClient:
    return ServerClient([url], make_config(url, **rollout).rollout, sleep=sleeps.append)


def test_failures_are_retried_with_exponential_backoff(servers):
    server, sleeps = servers[0], []
    server.failures = [503, 502]
    client = client_for(server.url, sleeps, max_retries=3, retry_backoff=0.5)
    response = client.request(server.url, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert response.ok and len(server.requests_to("/v1/completions")) == 3 and sleeps == [0.5, 1.0]


def test_after_the_last_retry_the_error_names_the_server_and_the_call(servers):
    server, sleeps = servers[0], []
    server.failures = [503] * 5
    client = client_for(server.url, sleeps, max_retries=2, retry_backoff=1.0)
    with pytest.raises(ServerError) as error:
        client.request(server.url, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert str(error.value).startswith(f"POST /v1/completions to the vLLM server at {server.url} failed 3 time(s) "
                                       "(rollout.max_retries = 2); the last time: HTTP 503")
    assert error.value.status == 503 and len(server.requests_to("/v1/completions")) == 3 and sleeps == [1.0, 2.0]


def test_a_request_that_gets_no_answer_in_time_is_retried(servers):
    server, sleeps = servers[0], []
    server.failures, server.silence_s = ["silence"], 2.0
    client = client_for(server.url, sleeps, request_timeout=0.3, max_retries=1)
    started = time.monotonic()
    assert client.request(server.url, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1}).ok
    assert time.monotonic() - started < 1.5 and len(server.requests_to("/v1/completions")) == 2
    server.failures = ["silence", "silence"]
    with pytest.raises(ServerError, match=r"failed 2 time\(s\).*no answer within 0.3 s \(rollout.request_timeout\)"):
        client.request(server.url, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})


def test_a_final_status_is_not_retried(servers):
    server, sleeps = servers[0], []
    server.failures = [400]
    client = client_for(server.url, sleeps, max_retries=3)
    with pytest.raises(ServerError, match=f"POST /v1/completions to the vLLM server at {server.url} -> HTTP 400"):
        client.request(server.url, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 1})
    assert len(server.requests_to("/v1/completions")) == 1 and sleeps == []


def test_a_server_that_is_not_there_is_named_after_the_retries():
    url, sleeps = f"http://127.0.0.1:{free_port()}", []  # nothing listens there
    client = client_for(url, sleeps, max_retries=2, retry_backoff=0.25)
    with pytest.raises(ServerError, match=rf"GET /v1/models to the vLLM server at {url} failed 3 time\(s\).*"
                                          "could not connect"):
        client.request(url, "GET", "/v1/models")
    assert sleeps == [0.25, 0.5]


def test_one_url_as_today(servers):
    server = servers[0]
    generator = ServerGenerator(make_config(server.url + "/v1", api_key="secret"), "unused")
    assert generator.urls == [server.url] and generator.base_model == BASE
    (index, completions), = generator.stream([Request([1, 2], 3, 0, 4)], version=0)
    assert index == 0 and [c.token_ids for c in completions] == [[TOKEN] * 4] * 3
    assert all(headers["Authorization"] == "Bearer secret" for _, _, headers in server.seen)
    generator.close()


def test_requests_go_round_robin_each_whole_to_one_server(servers):
    generator = ServerGenerator(make_config([server.url for server in servers]), "unused")
    requests = [Request([100 + index], 3, 10 + index, 2) for index in range(6)]
    results = dict(generator.stream(requests, version=0))
    assert sorted(results) == list(range(6)) and all(len(results[index]) == 3 for index in range(6))
    seen = [server.requests_to("/v1/completions", "generation") for server in servers]
    assert [len(bodies) for bodies in seen] == [3, 3]  # half each
    assert all(body["n"] == 3 for bodies in seen for body in bodies)  # a request's samples all on one server
    prompts = sorted(body["prompt"][0] for bodies in seen for body in bodies)
    assert prompts == [100 + index for index in range(6)]  # each request exactly once
    generator.close()


def test_every_sync_loads_into_every_server_and_unloads_from_every_server(servers, tmp_path):
    generator = ServerGenerator(make_config([server.url for server in servers]), "unused")
    names = []
    for version in (1, 2, 3):
        generator.sync(tmp_path / f"v{version}", version)
        names.append(served(generator))
    for server in servers:
        assert [body["lora_name"] for body in server.requests_to("/v1/load_lora_adapter")] == names
        assert [body["lora_path"] for body in server.requests_to("/v1/load_lora_adapter")] == [
            str((tmp_path / f"v{version}").resolve()) for version in (1, 2, 3)]
        assert [body["lora_name"] for body in server.requests_to("/v1/unload_lora_adapter")] == names[:1]
        assert server.adapters == set(names[1:])  # the newest keep_versions = 2
    (_, completions), = generator.stream([Request([1], 1, 0, 2)], version=2)  # a kept older version
    assert completions and any(body["model"] == names[1] for server in servers
                               for body in server.requests_to("/v1/completions", "generation"))
    generator.close()  # servers we only connected to: our adapters unloaded from each
    assert all(server.adapters == set() for server in servers)


def test_a_load_whose_answer_was_lost_counts_as_loaded(servers, tmp_path):
    server = servers[0]
    generator = ServerGenerator(make_config(server.url, request_timeout=0.3, max_retries=2), "unused")
    server.failures, server.silence_s = ["silence"], 1.0  # loaded, but the answer comes too late
    generator.sync(tmp_path / "v1", version=1)
    loads = server.requests_to("/v1/load_lora_adapter")
    assert len(loads) == 2 and loads[0] == loads[1] and server.adapters == {served(generator)}
    generator.close()


def test_a_failed_load_names_the_server_and_the_version(servers, tmp_path):
    generator = ServerGenerator(make_config([server.url for server in servers], max_retries=1), "unused")
    servers[1].failures = [500, 500]
    with pytest.raises(ServerError) as error:
        generator.sync(tmp_path / "v4", version=4)
    assert f"loading adapter version 4 from {(tmp_path / 'v4').resolve()} failed" in str(error.value)
    assert f"to the vLLM server at {servers[1].url} failed 2 time(s)" in str(error.value)
    generator.close()


def test_the_sync_probe_checks_every_server(servers, tmp_path):
    """Each server is probed and checked against the trainer by a verifier of its own: one serving other
    weights than the trainer's is named."""
    generator = ServerGenerator(make_config([server.url for server in servers]), "unused")
    verifier = SyncVerifier(PROBE, dtype=torch.float32, same_base=True, tolerance=1e-3)
    trainer = torch.tensor([-1.0 - 0.01 * token for token in PROBE[1:]])
    generator.sync(tmp_path / "v1", version=1)
    metrics = generator.verify_each(verifier, trainer, version=1)
    assert metrics["sync/probe_max_abs_diff"] < 1e-6
    assert all(len(server.requests_to("/v1/completions", "probe")) == 1 for server in servers)
    assert all(server.requests_to("/v1/completions", "probe")[0]["model"] == served(generator)
               for server in servers)
    servers[1].probe_shift = 0.5  # the second server no longer serves what the trainer holds
    generator.sync(tmp_path / "v2", version=2)
    with pytest.raises(SyncError, match=f"the vLLM server at {servers[1].url}: adapter version 2: vLLM's probe "
                                        "logprobs differ from the trainer's by 0.5"):
        generator.verify_each(verifier, trainer, version=2)
    generator.close()
