"""A small Hugging Face Hub stand-in on 127.0.0.1 for tests (no network).

It serves the endpoints huggingface_hub 2.4.0 and ``localdiff pull`` call:

- ``GET /api/models/{repo}/revision/{rev}[?blobs=true]`` — revision info: ``sha`` and ``siblings[]`` with ``size``,
  ``blobId`` and, for LFS files, ``lfs {sha256, size, pointerSize}``;
- ``GET /api/models/{repo}/tree/{rev}?recursive=true`` — the tree listing (used by ``snapshot_download``);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` — ``ETag`` (git blob sha1), ``X-Linked-Etag`` / ``X-Linked-Size``
  (LFS sha256 / size), ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges`` and ``Range`` → 206.

Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), so
huggingface_hub raises its real exception classes. Test hooks: ``pause_after`` (block a GET after N bytes until an
event is set), ``cut_after`` (close the connection after N bytes, once), ``fail_next`` (answer HTTP errors such as 503
or 429 with Retry-After before serving), ``short_next`` (complete but empty responses), and counters of bytes served
per file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with this content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A repo: revisions (name → commit), commits (commit → files: path → bytes), gating, which files are LFS."""

    revisions: dict = field(default_factory=dict)
    commits: dict = field(default_factory=dict)
    gated: bool = False
    lfs_patterns: tuple = ("*.safetensors", "*.bin")

    def files_at(self, rev: str) -> tuple:
        """(commit, files) for a revision name or commit; (None, None) when unknown."""
        commit = self.revisions.get(rev, rev if rev in self.commits else None)
        return (commit, self.commits[commit]) if commit else (None, None)

    def is_lfs(self, path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) for p in self.lfs_patterns)

    def sibling(self, path: str, data: bytes) -> dict:
        out = {"rfilename": path, "size": len(data), "blobId": git_blob_sha1(data)}
        if self.is_lfs(path):
            out["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


@dataclass
class Stats:
    """What the server did: requests (method, path, Range header) and bytes served per (repo, file)."""

    requests: list = field(default_factory=list)
    bytes_served: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key, n: int) -> None:
        with self.lock:
            self.bytes_served[key] = self.bytes_served.get(key, 0) + n

    def served(self, repo: str, path: str) -> int:
        with self.lock:
            return self.bytes_served.get((repo, path), 0)

    def gets(self, repo: str, path: str) -> list:
        """Range headers (or None) of the GET requests for one file."""
        with self.lock:
            return [r[2] for r in self.requests if r[0] == "GET" and r[1] == (repo, path)]


class StandInHub:
    """Run with ``with StandInHub() as hub: ...``; ``hub.url`` is the HF_ENDPOINT to use."""

    def __init__(self, token: str = "hf_good"):
        self.repos: dict[str, Repo] = {}
        self.stats = Stats()
        self.token = token
        self.pause_after: dict = {}  # (repo, path) -> (nbytes, threading.Event)
        self.cut_after: dict = {}  # (repo, path) -> nbytes (applies once)
        self.corrupt: set = set()  # (repo, path) served with the last byte flipped
        self.fail_next: dict = {}  # (repo, path or None = revision info) -> [(status, headers)] answered first
        self.short_next: dict = {}  # (repo, path) -> n: the next n GETs answer an empty body (Content-Length 0)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_repo(
        self, repo_id: str, files: dict, revision: str = "main", gated: bool = False, commit: str | None = None
    ) -> str:
        """Add (or move) ``revision`` of ``repo_id`` to a commit holding ``files``; returns the commit sha.

        ``commit`` names that commit (40 hex) instead of one derived from the files: a repo the catalog pins."""
        h = hashlib.sha1(repo_id.encode())
        for k in sorted(files):
            h.update(k.encode() + b"\0" + hashlib.sha1(files[k]).digest())
        commit = commit or h.hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = gated
        repo.commits[commit] = dict(files)
        repo.revisions[revision] = commit
        return commit

    def add_as_catalog(self, repo_id: str, files: dict) -> str:
        """Add ``repo_id`` as the catalog pulls it: ``main`` at the commit its entry pins, when it pins one."""
        from localdiff.hub.catalog import entry_for_repo

        e = entry_for_repo(repo_id)
        pinned = e.revision if e is not None and re.fullmatch(r"[0-9a-f]{40}", e.revision) else None
        return self.add_repo(repo_id, files, commit=pinned)

    def __enter__(self) -> "StandInHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for _, ev in self.pause_after.values():
            ev.set()
        self.server.shutdown()
        self.server.server_close()

    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def handle(self):
                try:
                    super().handle()
                except (ConnectionResetError, BrokenPipeError):  # the client went away (kill -9, cut tests)
                    pass

            def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
                body = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _repo(self, repo_id: str, rev: str | None):
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(401, "RepoNotFound", "Repository not found")
                    return None
                if repo.gated:
                    auth = self.headers.get("Authorization", "")
                    if auth != f"Bearer {hub.token}":
                        status = 401 if not auth else 403
                        self._error(
                            status,
                            "GatedRepo",
                            "Access to this model is restricted. You must have access "
                            "to it and be authenticated to access it. Please log in.",
                        )
                        return None
                commit, files = repo.files_at(rev)
                if commit is None:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                    return None
                return repo, commit, files

            def do_GET(self):
                self._dispatch()

            def do_HEAD(self):
                self._dispatch()

            def _dispatch(self):
                u = urlparse(self.path)
                path = unquote(u.path)
                m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/(.+)$", path)
                if m and self.command == "GET":
                    return self._revision_info(m.group(1), m.group(2))
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?$", path)
                if m and self.command == "GET":
                    return self._tree(m.group(1), m.group(2))
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if m:
                    return self._resolve(m.group(1), m.group(2), m.group(3))
                self._error(404, "NotFound", f"no route {path}")

            def _injected_failure(self, key) -> bool:
                """Answer the next queued (status, headers) for ``key``, if any; True when one was sent."""
                with hub.stats.lock:
                    queue = hub.fail_next.get(key)
                    failure = queue.pop(0) if queue else None
                if failure is None:
                    return False
                status, headers = failure
                body = json.dumps({"error": f"injected {status}"}).encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                return True

            def _revision_info(self, repo_id, rev):
                with hub.stats.lock:
                    hub.stats.requests.append(("INFO", (repo_id, None), rev))
                if self._injected_failure((repo_id, None)):
                    return
                found = self._repo(repo_id, rev)
                if found is None:
                    return
                repo, commit, files = found
                blobs = "blobs" in parse_qs(urlparse(self.path).query)
                siblings = [repo.sibling(p, files[p]) if blobs else {"rfilename": p} for p in sorted(files)]
                self._json(
                    {
                        "_id": "x",
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": commit,
                        "private": False,
                        "gated": "manual" if repo.gated else False,
                        "disabled": False,
                        "siblings": siblings,
                        "tags": [],
                        "downloads": 0,
                        "likes": 0,
                    }
                )

            def _tree(self, repo_id, rev):
                found = self._repo(repo_id, rev)
                if found is None:
                    return
                repo, commit, files = found
                items = []
                for p in sorted(files):
                    s = repo.sibling(p, files[p])
                    item = {"type": "file", "path": p, "size": s["size"], "oid": s["blobId"]}
                    if "lfs" in s:
                        item["lfs"] = {"oid": s["lfs"]["sha256"], "size": s["size"], "pointerSize": 134}
                    items.append(item)
                self._json(items)

            def _resolve(self, repo_id, rev, fpath):
                found = self._repo(repo_id, rev)
                if found is None:
                    return
                repo, commit, files = found
                key = (repo_id, fpath)
                with hub.stats.lock:
                    hub.stats.requests.append((self.command, key, self.headers.get("Range")))
                if fpath not in files:
                    return self._error(404, "EntryNotFound", f"{fpath} does not exist", commit=commit)
                if self.command == "GET" and self._injected_failure(key):
                    return
                if self.command == "GET" and hub.short_next.get(key):
                    hub.short_next[key] -= 1
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = files[fpath]
                s = repo.sibling(fpath, data)
                if key in hub.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                start, status = 0, 200
                rng = self.headers.get("Range")
                if rng and self.command == "GET":
                    mm = re.match(r"bytes=(\d+)-$", rng)
                    if not mm or int(mm.group(1)) >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start, status = int(mm.group(1)), 206
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{s["blobId"]}"')
                if "lfs" in s:
                    self.send_header("X-Linked-Etag", f'"{s["lfs"]["sha256"]}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if self.command == "HEAD":
                    return
                self._send_body(key, data, start)

            def _send_body(self, key, data: bytes, start: int) -> None:
                pos = start
                pause = hub.pause_after.get(key)
                cut = hub.cut_after.pop(key, None)
                while pos < len(data):
                    end = min(pos + 16384, len(data))
                    if pause is not None and pos < pause[0] <= end:
                        end = pause[0]
                    if cut is not None and pos < cut <= end:
                        end = cut
                    try:
                        self.wfile.write(data[pos:end])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    hub.stats.add(key, end - pos)
                    pos = end
                    if cut is not None and pos == cut:
                        self.close_connection = True
                        return
                    if pause is not None and pos == pause[0]:
                        pause[1].wait(30)
                        hub.pause_after.pop(key, None)
                        self.close_connection = True
                        return

        return Handler


def tiny_checkpoint_files(weight_bytes: int = 300_000, seed: int = 0) -> dict:
    """Files of a small fake checkpoint repo: config.json, tokenizer files, a safetensors shard (valid header,
    pseudo-random payload), and a pickle ``pytorch_model.bin`` that pulls must skip."""
    import random
    import struct

    rnd = random.Random(seed)
    n = weight_bytes // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, n * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    st = struct.pack("<Q", len(header)) + header + bytes(rnd.getrandbits(8) for _ in range(n * 4))
    config = {
        "model_type": "diffusion_gemma",
        "canvas_length": 16,
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 128,
            "num_experts": 4,
            "top_k_experts": 2,
            "dtype": "float32",
        },
    }
    return {
        "config.json": json.dumps(config, indent=1).encode(),
        "generation_config.json": json.dumps({"max_denoising_steps": 8}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "WordLevel"}}).encode(),
        "model.safetensors": st,
        "pytorch_model.bin": b"\x80\x04pickle-that-must-not-be-pulled" * 10,
        "README.md": b"# tiny\n",
    }
