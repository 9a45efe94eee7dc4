"""HTTP to one vLLM server or several data-parallel ones: every call has a timeout
(rollout.request_timeout) and is retried with exponential backoff (rollout.max_retries,
rollout.retry_backoff) when the server could not be reached, did not answer in time, or answered
429 / 5xx; after the last retry a ServerError names the server's URL, the call and the last failure.
Requests are spread round-robin over the servers, each request whole to one server.

Retrying is safe for every call the driver makes: generation requests are seeded, so a retried one
samples the same tokens; loading an adapter under a name the server already holds (a load whose answer
was lost) counts as loaded; unloading one it no longer holds counts as unloaded.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import requests
from requests.adapters import HTTPAdapter

from driver.config import RolloutConfig
from driver.engine.launch import ServerError

MAX_CONNECTIONS = 64  # per server: the requests in flight at once (generation sends one per prompt)
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})  # busy or failing for now; other statuses are final


class ServerClient:
    def __init__(self, urls: list[str], rollout: RolloutConfig, exit_note: Callable[[], str] = lambda: "",
                 sleep: Callable[[float], None] = time.sleep) -> None:
        """exit_note(): why no retry can help (the launched server exited), or ''."""
        self.urls = urls
        self.timeout, self.max_retries = rollout.request_timeout, rollout.max_retries
        self.backoff = rollout.retry_backoff
        self._exit_note, self._sleep = exit_note, sleep
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=len(urls), pool_maxsize=MAX_CONNECTIONS)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if rollout.api_key:
            self.session.headers["Authorization"] = f"Bearer {rollout.api_key}"
        self._turn = itertools.count()
        self._turn_lock = threading.Lock()

    def next_url(self) -> str:
        """The server for the next request, round-robin (thread-safe: the prefetch thread generates too)."""
        with self._turn_lock:
            return self.urls[next(self._turn) % len(self.urls)]

    def request(self, url: str, method: str, path: str, payload: dict | None = None, allowed: tuple[int, ...] = (),
                timeout: float | None = None, retries: int | None = None) -> requests.Response:
        """One call to the server at url, retried as the module says; any status other than a success or
        one of `allowed` raises ServerError with the server's answer."""
        timeout = self.timeout if timeout is None else timeout
        retries = self.max_retries if retries is None else retries
        call = f"{method} {path} to the vLLM server at {url}"
        for attempt in range(retries + 1):
            status = None
            try:
                response = self.session.request(method, url + path, json=payload, timeout=timeout)
            except requests.Timeout:
                failure = f"no answer within {timeout:g} s (rollout.request_timeout)"
            except requests.ConnectionError as error:
                failure = f"could not connect ({error})"
            except requests.RequestException as error:  # a malformed URL or request: no retry helps
                raise ServerError(f"{call} failed: {error}{self._exit_note()}") from error
            else:
                status = response.status_code
                if response.ok or status in allowed:
                    return response
                failure = f"HTTP {status}: {response.text}"
                if status not in RETRY_STATUSES:
                    raise ServerError(f"{call} -> {failure}{self._exit_note()}", status)
            exit_note = self._exit_note()
            if exit_note:  # the server we launched is gone: retrying cannot bring it back
                raise ServerError(f"{call} failed: {failure}{exit_note}", status)
            if attempt < retries:
                self._sleep(self.backoff * 2 ** attempt)
        raise ServerError(f"{call} failed {retries + 1} time(s) (rollout.max_retries = {retries}); the last time: "
                          f"{failure}", status)

    def close(self) -> None:
        self.session.close()
