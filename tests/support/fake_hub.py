"""A Hugging Face Hub stand-in on 127.0.0.1 for the tests: the endpoints huggingface_hub's
`snapshot_download` and `hf_hub_download` call, with the headers and error codes they read
(huggingface_hub/utils/_http.py `hf_raise_for_status`, file_download.py `get_hf_file_metadata`):

- `GET /api/models/{repo}/revision/{rev}`: the commit `sha` and the file names (`siblings`);
- `GET /api/models/{repo}/tree/{rev}`: the recursive file listing, LFS metadata for weights;
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` (the git blob
  id; for LFS files `X-Linked-Etag`, the sha256, and `X-Linked-Size`) and `Content-Length`.

Errors: an unknown repo is 404 `X-Error-Code: RepoNotFound`, an unknown revision 404
`RevisionNotFound`, a missing file 404 `EntryNotFound`, a gated repo's files 401 `GatedRepo`.
Every request is recorded, so a test can tell which files were fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".onnx")
HANDLER_TIMEOUT_S = 10.0  # a client that stops talking frees its handler thread


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> path in repo -> content
    refs: dict[str, str]  # branch or tag -> commit sha
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo]
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    url: str = ""  # set by start(), kept after stop(): a dead endpoint for offline tests
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None

    def fetched(self) -> list[str]:
        """Paths of the files whose content was sent (GET on /resolve/)."""
        with self._lock:
            return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    def record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    timeout = HANDLER_TIMEOUT_S

    def log_message(self, format: str, *args: object) -> None:
        pass  # the request list is the log

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.fake.record(self.command, path)
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            sha, files = commit
            if kind == "revision":
                siblings = [{"rfilename": name} for name in sorted(files)]
                info = {"id": repo_id, "sha": sha, "siblings": siblings, "private": False}
                info["gated"] = "manual" if self.fake.repos[repo_id].gated else False
                return self._json(info, body)
            if kind == "tree":
                return self._json(_tree(files), body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            commit = self._commit(repo_id, revision)
            if commit is None:
                return
            sha, files = commit
            if self.fake.repos[repo_id].gated:
                message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it. Please log in."
                return self._error(401, "GatedRepo", message)
            if name not in files:
                return self._error(404, "EntryNotFound", f"{name} does not exist", commit=sha)
            return self._file(sha, name, files[name], body)
        self._error(404, None, "not a Hub endpoint")

    def _commit(self, repo_id: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        sha = repo.refs.get(revision, revision)
        if sha not in repo.commits:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return None
        return sha, repo.commits[sha]

    def _file(self, sha: str, name: str, data: bytes, body: bool) -> None:
        self.send_response(200)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{git_blob_id(data)}"')
        if name.endswith(LFS_SUFFIXES):
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _json(self, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(
        self, status: int, code: str | None, message: str, commit: str | None = None
    ) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def _tree(files: dict[str, bytes]) -> list[dict[str, object]]:
    """The recursive listing, folders first as the Hub sends them."""
    folders = sorted({name.rsplit("/", 1)[0] for name in files if "/" in name})
    entries: list[dict[str, object]] = [
        {"type": "directory", "oid": git_blob_id(folder.encode()), "size": 0, "path": folder}
        for folder in folders
    ]
    for name in sorted(files):
        data = files[name]
        entry: dict[str, object] = {
            "type": "file",
            "oid": git_blob_id(data),
            "size": len(data),
            "path": name,
        }
        if name.endswith(LFS_SUFFIXES):
            digest = hashlib.sha256(data).hexdigest()
            entry["lfs"] = {"oid": digest, "size": len(data), "pointerSize": 134}
        entries.append(entry)
    return entries


def read_folder(folder: Path) -> dict[str, bytes]:
    """A model folder's files as a commit's contents."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
