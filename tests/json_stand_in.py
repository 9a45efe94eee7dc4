"""A local HTTP server that answers JSON, scripted request by request: the stand-in for NeMo Gym's servers
(the resources server's POST /verify in tests/driver/rewards/test_nemo_gym.py; the agent server's POST /run and
a head server's GET /global_config_dict_yaml in tests/driver/rollouts/test_agent_runs.py) and for TRL's
vllm-serve (tests/driver/engine/test_server_is_vllm.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a scripted "drop" fails the handler's last write: expected


class JSONHandler(BaseHTTPRequestHandler):
    """A request handler that answers in JSON and logs nothing (tests/hub_stand_in.py's too)."""

    def log_message(self, *args) -> None:
        pass

    def answer(self, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class ScriptedJSONServer:
    """POST: answered by `answer(body)`, after `delay` s, unless `script` (a list, consumed one request at a time)
    names the next answer: an HTTP status code, "drop" (close the connection unanswered) or a dict (answered as
    it is). `requests` keeps every POST body; `most_in_flight` the most requests being answered at once. GET:
    `get(path)` as JSON, or a (status, payload) pair."""

    def __init__(self, answer: Callable[[dict], dict], get: Callable[[str], object] = lambda path: {"status": "ok"}):
        self.requests: list[dict] = []
        self.script: list = []
        self.delay = 0.0
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        stand_in = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                answer = get(self.path)
                self.answer(*(answer if isinstance(answer, tuple) else (200, answer)))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stand_in.lock:
                    stand_in.requests.append(body)
                    step = stand_in.script.pop(0) if stand_in.script else None
                    stand_in.in_flight += 1
                    stand_in.most_in_flight = max(stand_in.most_in_flight, stand_in.in_flight)
                time.sleep(stand_in.delay)
                # Out of flight before the answer leaves: a client that has it may send its next request at once.
                with stand_in.lock:
                    stand_in.in_flight -= 1
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif isinstance(step, int):
                    self.answer(step, {"detail": f"scripted {step}"})
                else:
                    self.answer(200, step if isinstance(step, dict) else answer(body))

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
