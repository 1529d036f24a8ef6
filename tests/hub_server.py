"""A local fake of the Hugging Face Hub, just big enough for neox_hf.hub and its tests.

The real `huggingface_hub` client talks to it unmodified: point the client at `FakeHub.endpoint`
(see `tests/test_hub.py` for how). It implements only the routes that client uses for
`create_repo`, `create_branch`, `upload_folder` (with its README.md YAML check), `model_info` /
`repo_info`, `list_repo_tree`, `list_repo_refs`, `hf_hub_download` and `snapshot_download`.

Simplifications against the real Hub, each chosen so the client takes its plainest path:
- preupload answers "regular" for every file, so contents arrive base64-inline in the commit
  ndjson. No LFS batch route and no Xet headers are served, so `hf_xet` never transfers data
  (upload_folder still opens a local Xet session when hf_xet is installed; that is harmless).
- a new repo has an empty initial commit (the real Hub seeds `.gitattributes`), so a test can
  assert that a branch holds exactly the files pushed to it.
- every commit is stored as a full snapshot directory `<root>/<namespace>/<name>/commits/<sha>/`,
  and each branch head as a file `<root>/<namespace>/<name>/refs/<branch>` holding its sha.

Fault injection: `fail_next(route, times, status)` answers the next `times` requests to a route
with `status`; `pause(route)` holds requests to a route until `resume(route)`. Tokens: a request
whose Bearer token is not in `tokens` gets the Hub's 401 "Invalid credentials"; writes need a
valid token, reads of these (always public) repos do not.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"

# (route name, method, regex over the URL path). Repo ids are always "namespace/name".
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [
    ("create_repo", "POST", re.compile(r"^/api/repos/create$")),
    ("validate_yaml", "POST", re.compile(r"^/api/validate-yaml$")),
    ("create_branch", "POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$")),
    ("preupload", "POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$")),
    ("commit", "POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$")),
    ("refs", "GET", re.compile(rf"^/api/models/{_REPO}/refs$")),
    ("tree", "GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("model_info", "GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("resolve", "GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("resolve", "HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]
_WRITE_ROUTES = {"create_repo", "create_branch", "preupload", "commit"}


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of `data`: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Reply:
    """One HTTP answer: status, JSON-able body (or raw bytes), extra headers."""

    status: int
    body: object = None
    headers: dict[str, str] | None = None


def _error(status: int, message: str, code: str | None = None) -> Reply:
    # huggingface_hub maps X-Error-Code to its typed errors (RepoNotFound, RevisionNotFound, ...).
    headers = {"X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    return Reply(status, {"error": message}, headers)


class FakeHub:
    """The fake Hub's state (repos on disk, tokens, faults) and its HTTP server thread."""

    def __init__(self, root: Path, tokens: dict[str, str] | None = None):
        self.root = Path(root)
        self.tokens = dict(tokens or {"hf_test_write_token": "tester"})  # token -> user name
        self.requests: list[tuple[str, str]] = []  # (route, url path) in arrival order
        self.commits: list[tuple[str, str, str]] = []  # (repo_id, branch, commit message)
        self._faults: dict[str, list[int]] = {}  # route -> statuses still to answer
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.RLock()  # one request mutates repo state at a time
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        # A short poll interval makes stop() (shutdown) return in milliseconds, not the default 0.5 s.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-hub", daemon=True
        )

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        for gate in self._gates.values():
            gate.set()  # never leave a handler thread blocked
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- knobs for tests

    def fail_next(self, route: str, times: int = 1, status: int = 503) -> None:
        """Answer the next `times` requests to `route` with `status` (before any auth check)."""
        with self._lock:
            self._faults.setdefault(route, []).extend([status] * times)

    def pause(self, route: str) -> None:
        """Hold every request to `route` until `resume(route)`."""
        self._gates[route] = threading.Event()

    def resume(self, route: str) -> None:
        self._gates.pop(route).set()

    def count(self, route: str) -> int:
        """How many requests reached `route`, failed ones included."""
        return sum(1 for name, _ in self.requests if name == route)

    # ---- reading stored state (what the tests assert on)

    def branches(self, repo_id: str) -> list[str]:
        refs = self._repo_dir(repo_id) / "refs"
        return sorted(p.name for p in refs.iterdir()) if refs.is_dir() else []

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Path -> content of every file at `revision` (a branch or a commit sha)."""
        snapshot = self._snapshot_dir(repo_id, self._resolve(repo_id, revision))
        return {
            p.relative_to(snapshot).as_posix(): p.read_bytes() for p in sorted(snapshot.rglob("*")) if p.is_file()
        }

    # ---- storage

    def _repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_id

    def _snapshot_dir(self, repo_id: str, sha: str) -> Path:
        return self._repo_dir(repo_id) / "commits" / sha

    def _resolve(self, repo_id: str, revision: str) -> str | None:
        """The commit sha a branch name or sha points to, or None."""
        ref = self._repo_dir(repo_id) / "refs" / revision
        if ref.is_file():
            return ref.read_text()
        if re.fullmatch(r"[0-9a-f]{40}", revision) and self._snapshot_dir(repo_id, revision).is_dir():
            return revision
        return None

    def _write_commit(
        self, repo_id: str, branch: str, parent: str | None, files: dict[str, bytes], message: str
    ) -> str:
        listing = "".join(f"{path}\0{git_blob_oid(data)}\n" for path, data in sorted(files.items()))
        sha = hashlib.sha1(f"{parent}\n{branch}\n{message}\n{listing}".encode()).hexdigest()
        snapshot = self._snapshot_dir(repo_id, sha)
        if not snapshot.is_dir():
            for path, data in files.items():
                target = snapshot / path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            snapshot.mkdir(parents=True, exist_ok=True)  # an empty commit still has a directory
        self._set_ref(repo_id, branch, sha)
        return sha

    def _set_ref(self, repo_id: str, branch: str, sha: str) -> None:
        ref = self._repo_dir(repo_id) / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha)

    # ---- request dispatch

    def handle(self, method: str, url: str, headers, body: bytes) -> Reply:
        path = urlsplit(url).path
        name, params = _match_route(method, path)
        with self._lock:
            self.requests.append((name or "unknown", path))
            fault = self._faults.get(name or "")
            status = fault.pop(0) if fault else None
        if name is None:
            return _error(404, f"fake hub has no route for {method} {path}")
        if status is not None:
            return _error(status, f"injected {status}")
        gate = self._gates.get(name)
        if gate is not None:
            gate.wait(timeout=30)
        user, denied = self._authenticate(headers, write=name in _WRITE_ROUTES)
        if denied:
            return denied
        with self._lock:
            return getattr(self, f"_on_{name}")(user=user, body=body, query=urlsplit(url).query, **params)

    def _authenticate(self, headers, *, write: bool) -> tuple[str | None, Reply | None]:
        auth = headers.get("authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        if token is not None and token not in self.tokens:
            return None, _error(401, INVALID_CREDENTIALS)
        if write and token is None:
            return None, _error(401, "You must be authenticated to write")
        return self.tokens.get(token or ""), None

    def _repo_or_404(self, repo: str) -> Reply | None:
        if not (self._repo_dir(repo) / "refs").is_dir():
            return _error(404, f"Repository {repo} not found", "RepoNotFound")
        return None

    def _sha_or_404(self, repo: str, rev: str) -> tuple[str | None, Reply | None]:
        missing = self._repo_or_404(repo)
        if missing:
            return None, missing
        sha = self._resolve(repo, rev)
        if sha is None:
            return None, _error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha, None

    # ---- write routes

    def _on_create_repo(self, *, user, body, **_) -> Reply:
        payload = json.loads(body or b"{}")
        if payload.get("type", "model") != "model":
            return _error(400, "fake hub only hosts model repos")
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        url = f"{self.endpoint}/{repo_id}"
        if self._repo_or_404(repo_id) is None:
            # The client treats 409 as "exists" under exist_ok=True.
            return Reply(409, {"error": "You already created this model repo", "url": url})
        self._write_commit(repo_id, "main", None, {}, "initial commit")
        return Reply(200, {"url": url, "name": repo_id, "id": repo_id})

    def _on_validate_yaml(self, *, body, **_) -> Reply:
        # upload_folder sends README.md here before uploading: reject front matter that is not YAML.
        content = json.loads(body)["content"]
        if content.startswith("---\n") and "\n---" in content[3:]:
            try:
                yaml.safe_load(content[4 : content.index("\n---", 3)])
            except yaml.YAMLError as err:
                return Reply(400, {"errors": [{"message": str(err)}], "warnings": []})
        return Reply(200, {"errors": [], "warnings": []})

    def _on_create_branch(self, *, repo, rev, body, **_) -> Reply:
        missing = self._repo_or_404(repo)
        if missing:
            return missing
        if (self._repo_dir(repo) / "refs" / rev).is_file():
            return _error(409, f"Reference {rev} already exists")
        start = json.loads(body or b"{}").get("startingPoint", "main")
        sha = self._resolve(repo, start)
        if sha is None:
            return _error(404, f"Invalid rev id: {start}", "RevisionNotFound")
        self._set_ref(repo, rev, sha)
        return Reply(200, {})

    def _on_preupload(self, *, repo, rev, body, **_) -> Reply:
        sha, missing = self._sha_or_404(repo, rev)
        if missing:
            return missing
        snapshot = self._snapshot_dir(repo, sha)
        files = []
        for entry in json.loads(body)["files"]:
            existing = snapshot / entry["path"]
            oid = git_blob_oid(existing.read_bytes()) if existing.is_file() else None
            # "regular" for every file: contents come inline in the commit, no LFS/Xet transfer.
            files.append({"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return Reply(200, {"files": files})

    def _on_commit(self, *, repo, rev, body, **_) -> Reply:
        parent, missing = self._sha_or_404(repo, rev)
        if missing:
            return missing
        if not (self._repo_dir(repo) / "refs" / rev).is_file():
            return _error(400, f"Can only commit to a branch, not {rev}")
        files = self.files(repo, parent)
        summary = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(prefix)}
            else:
                return _error(400, f"fake hub does not support commit operation {key!r}")
        sha = self._write_commit(repo, rev, parent, files, summary)
        self.commits.append((repo, rev, summary))
        return Reply(200, {"commitUrl": f"{self.endpoint}/{repo}/commit/{sha}", "commitOid": sha,
                           "success": True, "pullRequestUrl": None})

    # ---- read routes

    def _on_refs(self, *, repo, **_) -> Reply:
        missing = self._repo_or_404(repo)
        if missing:
            return missing
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": self._resolve(repo, b)}
                    for b in self.branches(repo)]
        return Reply(200, {"branches": branches, "tags": [], "converts": []})

    def _on_tree(self, *, repo, rev, path=None, query="", **_) -> Reply:
        sha, missing = self._sha_or_404(repo, rev)
        if missing:
            return missing
        prefix = unquote(path).strip("/") + "/" if path else ""
        recursive = "recursive=true" in query.lower()
        entries, folders = [], set()
        for file_path, data in self.files(repo, sha).items():
            if not file_path.startswith(prefix):
                continue
            rest = file_path[len(prefix) :]
            if not recursive and "/" in rest:
                folders.add(prefix + rest.split("/")[0])
                continue
            entries.append({"type": "file", "path": file_path, "size": len(data), "oid": git_blob_oid(data)})
        entries += [{"type": "directory", "path": f, "oid": "0" * 40, "size": 0} for f in sorted(folders)]
        return Reply(200, entries)

    def _on_model_info(self, *, repo, rev=None, **_) -> Reply:
        sha, missing = self._sha_or_404(repo, rev or "main")
        if missing:
            return missing
        siblings = [{"rfilename": p} for p in self.files(repo, sha)]
        return Reply(200, {"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": siblings,
                           "tags": [], "downloads": 0, "likes": 0})

    def _on_resolve(self, *, repo, rev, path, **_) -> Reply:
        sha, missing = self._sha_or_404(repo, rev)
        if missing:
            return missing
        file = self._snapshot_dir(repo, sha) / unquote(path)
        if not file.is_file():
            reply = _error(404, f"Entry not found: {path}", "EntryNotFound")
            reply.headers["X-Repo-Commit"] = sha  # lets the client cache the miss, as on the real Hub
            return reply
        data = file.read_bytes()
        # The three headers hf_hub_download needs: which commit, a stable ETag, and the size.
        return Reply(200, data, {"X-Repo-Commit": sha, "ETag": f'"{git_blob_oid(data)}"',
                                 "Content-Type": "application/octet-stream"})


def _match_route(method: str, path: str) -> tuple[str | None, dict[str, str]]:
    for name, route_method, pattern in _ROUTES:
        match = pattern.match(path) if route_method == method else None
        if match:
            params = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            if "path" in match.groupdict() and match.group("path") is not None:
                params["path"] = match.group("path")  # unquoted later, per file
            return name, params
    return None, {}


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            reply = hub.handle(method, self.path, self.headers, body)
            raw = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            self.send_response(reply.status)
            for key, value in (reply.headers or {}).items():
                self.send_header(key, value)
            if not isinstance(reply.body, bytes):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(raw)

        def do_GET(self):
            self._serve("GET")

        def do_HEAD(self):
            self._serve("HEAD")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, format, *args):  # keep pytest output clean
            pass

    return Handler

