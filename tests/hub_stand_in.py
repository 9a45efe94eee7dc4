"""A local stand-in for the Hugging Face Hub's write API (the Hub cannot be reached from these machines): the four
endpoints huggingface_hub's create_repo and create_commit call, answered as the Hub answers them, so the real
client's requests (auth header, preupload, the NDJSON commit with base64 file contents) are what is tested.
Every file is asked to come as a regular (inline) upload; the real Hub sends large ones through LFS / Xet."""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

from tests.json_stand_in import JSONHandler

USER = "tester"  # whose a bare repository name becomes, as the Hub gives it the token's user
TOKEN = "hf_stand_in_token"


@dataclass
class Repository:
    private: bool | None
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)


class HubStandIn:
    """`repos` holds what was created and committed; `fail_commits` answers that many commits with 503 first;
    `commits_open` cleared holds every commit until it is set again (an upload kept in flight)."""

    def __init__(self) -> None:
        self.repos: dict[str, Repository] = {}
        self.fail_commits = 0
        self.commits_open = threading.Event()
        self.commits_open.set()
        self.lock = threading.Lock()
        stand_in = self

        class Handler(JSONHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("authorization") != f"Bearer {TOKEN}":
                    return self.answer(401, {"error": "Invalid credentials in Authorization header"})
                if "/commit/" in self.path:
                    stand_in.commits_open.wait(timeout=60)
                self.answer(*stand_in.respond(self.path.split("?")[0], body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def respond(self, path: str, body: bytes) -> tuple[int, dict]:
        with self.lock:
            if path == "/api/repos/create":
                request = json.loads(body)
                repo_id = f"{request['organization'] or USER}/{request['name']}"
                if repo_id in self.repos:
                    return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
                self.repos[repo_id] = Repository(private=request.get("visibility") == "private"
                                                 if "visibility" in request else None)
                return 200, {"url": f"{self.url}/{repo_id}"}
            if path == "/api/validate-yaml":
                return 200, {}
            match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
            if match is None or match[1] not in self.repos:
                return 404, {"error": "Repository not found"}
            repository = self.repos[match[1]]
            if match[2] == "preupload":
                files = json.loads(body)["files"]
                return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in files]}
            if self.fail_commits:
                self.fail_commits -= 1
                return 503, {"error": "Service Unavailable"}
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            for line in lines:
                if line["key"] == "header":
                    repository.commits.append(line["value"]["summary"])
                elif line["key"] == "file":
                    repository.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            return 200, {"commitUrl": f"{self.url}/{match[1]}/commit/{len(repository.commits)}",
                         "commitOid": f"{len(repository.commits):040x}", "pullRequestUrl": None}
