"""A local stand-in for the Hugging Face Hub's write API (the Hub cannot be reached from these machines): the
endpoints huggingface_hub's create_repo, create_commit and list_repo_tree call, answered as the Hub answers them, so
the real client's requests (auth header, preupload, the NDJSON commit with base64 file contents and deleted files,
the tree of a folder) are what is tested. Every file is asked to come as a regular (inline) upload; the real Hub
sends large ones through LFS / Xet. The tree comes in one page (the Hub's hold up to 1000 entries)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import unquote

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
            def refused(self) -> bool:
                """Answered 401 unless the request carries the token, as the Hub does."""
                if self.headers.get("authorization") == f"Bearer {TOKEN}":
                    return False
                self.answer(401, {"error": "Invalid credentials in Authorization header"})
                return True

            def do_GET(self) -> None:
                if not self.refused():
                    self.answer(*stand_in.tree(self.path.split("?")[0]))

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.refused():
                    return
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
            missing = [line["value"]["path"] for line in lines
                       if line["key"] == "deletedFile" and line["value"]["path"] not in repository.files]
            if missing:  # the Hub refuses the whole commit
                return 404, {"error": f"File not found: {missing[0]}"}
            for line in lines:
                if line["key"] == "header":
                    repository.commits.append(line["value"]["summary"])
                elif line["key"] == "file":
                    repository.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                elif line["key"] == "deletedFile":
                    del repository.files[line["value"]["path"]]
            return 200, {"commitUrl": f"{self.url}/{match[1]}/commit/{len(repository.commits)}",
                         "commitOid": f"{len(repository.commits):040x}", "pullRequestUrl": None}

    def tree(self, path: str) -> tuple[int, dict | list]:
        """GET /api/models/{repo}/tree/{revision}/{folder}, recursive: the folder's files (the Hub's fields that
        huggingface_hub's RepoFile reads); 404 for a folder holding none."""
        with self.lock:
            match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/main(?:/(.+))?", path)
            if match is None or match[1] not in self.repos:
                return 404, {"error": "Repository not found"}
            prefix = f"{unquote(match[2]).rstrip('/')}/" if match[2] else ""  # the client quotes the folder's /
            files = {name: data for name, data in self.repos[match[1]].files.items() if name.startswith(prefix)}
            if prefix and not files:
                return 404, {"error": "Entry not found"}
            return 200, [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                         for name, data in sorted(files.items())]
