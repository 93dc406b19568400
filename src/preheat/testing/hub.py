"""A Hugging Face Hub-compatible server on 127.0.0.1, written from the Hub's public API.

Repositories live under a root directory (``state.json`` plus content-addressed objects);
``HubRepos`` writes them, ``hub_server`` serves them from a child process, which re-reads
``state.json`` whenever it changes, so a test may add a commit while the server runs::

    repos = HubRepos(tmp_path / "hub")
    sha = repos.commit("acme/tiny", {"config.json": b"{}", "model.safetensors": weights})
    with hub_server(repos.root) as hub:
        snapshot_download("acme/tiny", endpoint=hub.url)

What it serves (models only), with the Hub's headers and error codes:

- ``GET /api/models/{repo}[/revision/{rev}]``: ``id``, ``sha``, ``siblings`` (``?blobs=true``
  adds ``blobId``, ``size``, ``lfs``); ``rev`` is a branch, tag or full commit sha,
  URL-quoted (``refs%2Fpr%2F1``).
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true&expand=true``: entries
  ``{type, oid, size, path, lfs: {oid, size, pointerSize}}`` (``expand`` adds
  ``lastCommit``), ``page_size`` per page, the next page in a ``Link: <...>; rel="next"``.
- ``GET|HEAD /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``; a git file answers 200
  (Range honoured) with ``ETag: "<git blob id>"``; an LFS file answers 302 to the storage
  host with ``X-Linked-Etag: "<sha256>"`` and ``X-Linked-Size``, the ``Location`` signed
  and expiring after ``url_ttl`` s (the storage host answers 403 to a bad or expired one).
- Errors: ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``,
  ``GatedRepo``) and ``X-Error-Message``. A private repo is ``RepoNotFound`` (401) to
  anyone who may not read it; a gated repo is ``GatedRepo``, 401 without a token, 403 for
  an account that was not granted access; an unknown token is 401 ``Invalid credentials
  in Authorization header`` on any request.

Every request is appended to ``<root>/access.log`` as ``host method path status bytes
auth`` (``auth`` is ``token`` or ``-``, never the token) so tests can count what moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode

from aiohttp import web

from .procs import free_port, start_server

__all__ = ["HubRepos", "HubServer", "git_blob_id", "hub_server"]

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".h5", ".msgpack")
LFS_OVER = 10 << 20  # the Hub refuses git files over 10 MiB: bigger ones go to LFS
_SECRET = b"preheat-testing-hub"


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob: sha1 of ``b"blob <size>\\0" + data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


class HubRepos:
    """The repositories a test Hub serves, kept under ``root`` (written atomically)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        (self.root / "objects").mkdir(parents=True, exist_ok=True)
        self._state: dict[str, Any] = (
            json.loads((self.root / "state.json").read_text())
            if (self.root / "state.json").exists()
            else {"tokens": {}, "repos": {}}
        )

    def add_token(self, token: str, user: str) -> None:
        self._state["tokens"][token] = user
        self._save()

    def create(
        self,
        repo_id: str,
        *,
        private: bool = False,
        gated: bool = False,
        readers: tuple[str, ...] = (),
    ) -> None:
        """An empty repo; ``readers`` may read a private repo or were granted a gated one."""
        self._state["repos"][repo_id] = {
            "private": private,
            "gated": gated,
            "readers": list(readers),
            "branches": {},
            "tags": {},
            "commits": {},
        }
        self._save()

    def commit(
        self,
        repo_id: str,
        files: Mapping[str, bytes | Path],
        *,
        branch: str = "main",
        tag: str | None = None,
        delete: tuple[str, ...] = (),
        title: str = "update",
    ) -> str:
        """Add or replace ``files`` (bytes, or a file to hard-link) on ``branch``, on top
        of its head, and return the new commit sha. LFS: weight suffixes and files over
        10 MiB (as the Hub's default ``.gitattributes``)."""
        if repo_id not in self._state["repos"]:
            self.create(repo_id)
        repo = self._state["repos"][repo_id]
        parent = repo["branches"].get(branch)
        tree = dict(repo["commits"][parent]["files"]) if parent else {}
        for p in delete:
            tree.pop(p, None)
        for path, content in files.items():
            tree[path] = self._store(path, content)
        listing = json.dumps([parent, sorted(tree.items())]).encode()
        sha = hashlib.sha1(listing + str(len(repo["commits"])).encode()).hexdigest()
        repo["commits"][sha] = {
            "parent": parent,
            "title": title,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()),
            "files": tree,
        }
        repo["branches"][branch] = sha
        if tag is not None:
            repo["tags"][tag] = sha
        self._save()
        return sha

    def _store(self, path: str, content: bytes | Path) -> dict[str, Any]:
        if isinstance(content, Path):
            size = content.stat().st_size
            h = hashlib.sha256()
            with open(content, "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
            sha256 = h.hexdigest()
        else:
            size, sha256 = len(content), hashlib.sha256(content).hexdigest()
        lfs = path.endswith(LFS_SUFFIXES) or size > LFS_OVER
        if lfs:
            oid = git_blob_id(_pointer(sha256, size))
            dest = self.root / "objects" / sha256
        else:
            data = content.read_bytes() if isinstance(content, Path) else content
            oid = git_blob_id(data)
            dest = self.root / "objects" / oid
        if not dest.exists():
            tmp = dest.with_suffix(".tmp")
            if isinstance(content, Path):
                try:
                    os.link(content, tmp)
                except OSError:
                    tmp.write_bytes(content.read_bytes())
            else:
                tmp.write_bytes(content)
            os.replace(tmp, dest)
        return {"oid": oid, "size": size, "sha256": sha256 if lfs else None}

    def _save(self) -> None:
        tmp = self.root / f"state.json.{os.getpid()}"
        tmp.write_text(json.dumps(self._state))
        os.replace(tmp, self.root / "state.json")


# --- the server ---------------------------------------------------------------------------


class _Refusal(Exception):
    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def response(self) -> web.Response:
        headers = {"X-Error-Message": self.message}
        if self.code:
            headers["X-Error-Code"] = self.code
        return web.json_response({"error": self.message}, status=self.status, headers=headers)


class _Hub:
    def __init__(self, root: Path, storage_url: str, page_size: int, url_ttl: float) -> None:
        self.root = root
        self.storage_url = storage_url
        self.page_size = page_size
        self.url_ttl = url_ttl
        self._mtime = -1.0
        self._state: dict[str, Any] = {}

    def state(self) -> dict[str, Any]:
        m = (self.root / "state.json").stat().st_mtime
        if m != self._mtime:
            self._state = json.loads((self.root / "state.json").read_text())
            self._mtime = m
        return self._state

    def log(self, host: str, request: web.Request, status: int, size: int) -> None:
        auth = "token" if request.headers.get("Authorization") else "-"
        with open(self.root / "access.log", "a") as f:
            f.write(f"{host} {request.method} {request.raw_path} {status} {size} {auth}\n")

    def user(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        user = self.state()["tokens"].get(token)
        if user is None:
            raise _Refusal(401, None, "Invalid credentials in Authorization header")
        return str(user)

    def repo(self, request: web.Request, repo_id: str) -> dict[str, Any]:
        user = self.user(request)
        repo = self.state()["repos"].get(repo_id)
        may = repo is not None and user in repo["readers"]
        if repo is None or (repo["private"] and not may):
            status = 401 if user is None else 404
            raise _Refusal(status, "RepoNotFound", "Repository not found")
        if repo["gated"] and not may:
            if user is None:
                raise _Refusal(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it "
                    "and be authenticated to access it. Please log in.",
                )
            raise _Refusal(
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized "
                f"list. Visit https://huggingface.co/{repo_id} to ask for access.",
            )
        return repo

    @staticmethod
    def commit_of(repo: dict[str, Any], rev: str) -> str:
        for name in (rev, rev.removeprefix("refs/heads/")):
            if name in repo["branches"]:
                return str(repo["branches"][name])
        if rev.removeprefix("refs/tags/") in repo["tags"]:
            return str(repo["tags"][rev.removeprefix("refs/tags/")])
        if rev in repo["commits"]:
            return rev
        raise _Refusal(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    # -- /api/models/...

    def info(self, request: web.Request, repo_id: str, rev: str) -> web.Response:
        repo = self.repo(request, repo_id)
        sha = self.commit_of(repo, rev)
        commit = repo["commits"][sha]
        blobs = request.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, f in sorted(commit["files"].items()):
            s: dict[str, Any] = {"rfilename": path}
            if blobs:
                s.update(blobId=f["oid"], size=f["size"])
                if f["sha256"]:
                    s["lfs"] = {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}
            siblings.append(s)
        return web.json_response(
            {
                "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0],
                "sha": sha,
                "lastModified": commit["date"],
                "private": repo["private"],
                "gated": "manual" if repo["gated"] else False,
                "disabled": False,
                "tags": [],
                "siblings": siblings,
            }
        )

    def tree(self, request: web.Request, repo_id: str, rev: str, sub: str) -> web.Response:
        repo = self.repo(request, repo_id)
        sha = self.commit_of(repo, rev)
        commit = repo["commits"][sha]
        recursive = request.query.get("recursive", "").lower() in ("1", "true")
        expand = request.query.get("expand", "").lower() in ("1", "true")
        prefix = f"{sub.strip('/')}/" if sub.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in commit["files"]):
            raise _Refusal(404, "EntryNotFound", f"{sub} does not exist on {rev}")
        entries: dict[str, dict[str, Any]] = {}
        for path, f in sorted(commit["files"].items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix) :].split("/")
            for i in range(1, len(rest)):  # the directories above it
                d = prefix + "/".join(rest[:i])
                if (recursive or i == 1) and d not in entries:
                    oid = hashlib.sha1(d.encode() + sha.encode()).hexdigest()
                    entries[d] = {"type": "directory", "oid": oid, "size": 0, "path": d}
            if not recursive and len(rest) > 1:
                continue
            e: dict[str, Any] = {"type": "file", "oid": f["oid"], "size": f["size"], "path": path}
            if f["sha256"]:
                e["lfs"] = {"oid": f["sha256"], "size": f["size"], "pointerSize": 134}
            entries[path] = e
        listed = sorted(entries.values(), key=lambda e: str(e["path"]))
        if expand:
            last = {"id": sha, "title": commit["title"], "date": commit["date"]}
            listed = [{**e, "lastCommit": last} for e in listed]
        start = int(request.query.get("cursor", "0") or 0)
        page = listed[start : start + self.page_size]
        headers = {}
        if start + self.page_size < len(listed):
            query = {k: v for k, v in request.query.items() if k != "cursor"}
            query["cursor"] = str(start + self.page_size)
            nxt = f"{request.scheme}://{request.host}{request.path}?{urlencode(query)}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        return web.json_response(page, headers=headers)

    # -- /{repo}/resolve/{rev}/{path}

    def resolve(self, request: web.Request, repo_id: str, rev: str, path: str) -> web.Response:
        repo = self.repo(request, repo_id)
        sha = self.commit_of(repo, rev)
        f = repo["commits"][sha]["files"].get(path)
        if f is None:
            raise _Refusal(404, "EntryNotFound", "Entry not found")
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if f["sha256"]:
            expires = str(int(time.time() + self.url_ttl))
            sig = hmac.new(_SECRET, f"{f['sha256']}:{expires}".encode(), "sha256").hexdigest()
            query = urlencode({"X-Amz-Expires": expires, "X-Amz-Signature": sig})
            headers.update(
                {
                    "Location": f"{self.storage_url}/lfs/{f['sha256']}?{query}",
                    "X-Linked-Etag": f'"{f["sha256"]}"',
                    "X-Linked-Size": str(f["size"]),
                    "ETag": f'"{f["oid"]}"',
                }
            )
            return web.Response(status=302, headers=headers)
        data = (self.root / "objects" / f["oid"]).read_bytes()
        headers["ETag"] = f'"{f["oid"]}"'
        start, end = 0, len(data)
        status = 200
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes=") and data:
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, len(data) - int(b))
            end = min(len(data), int(b) + 1) if a and b else len(data)
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return web.Response(status=status, body=data[start:end], headers=headers)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        parts = [unquote(p) for p in request.raw_path.split("?", 1)[0].split("/")[1:]]
        try:
            if parts == ["health"]:
                resp: web.Response = web.Response(text="ok")
            elif parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                if len(parts) == 4:
                    resp = self.info(request, repo_id, "main")
                elif parts[4] == "revision" and len(parts) == 6:
                    resp = self.info(request, repo_id, parts[5])
                elif parts[4] == "tree" and len(parts) >= 6:
                    resp = self.tree(request, repo_id, parts[5], "/".join(parts[6:]))
                else:
                    raise _Refusal(404, None, "Sorry, we can't find the page you are looking for.")
            elif len(parts) >= 5 and parts[2] == "resolve":
                resp = self.resolve(request, "/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            else:
                raise _Refusal(404, None, "Sorry, we can't find the page you are looking for.")
        except _Refusal as refusal:
            resp = refusal.response()
        self.log("hub", request, resp.status, resp.content_length or 0)
        return resp

    async def storage(self, request: web.Request) -> web.StreamResponse:
        sha256 = request.match_info["sha256"]
        expires = request.query.get("X-Amz-Expires", "0")
        want = hmac.new(_SECRET, f"{sha256}:{expires}".encode(), "sha256").hexdigest()
        good = hmac.compare_digest(want, request.query.get("X-Amz-Signature", ""))
        path = self.root / "objects" / sha256
        if not good or float(expires) < time.time() or not path.is_file():
            self.log("storage", request, 403, 0)
            return web.Response(status=403, text="AccessDenied: Request has expired")
        size = path.stat().st_size
        a, _, b = request.headers.get("Range", "bytes=-").removeprefix("bytes=").partition("-")
        sent = (min(size, int(b) + 1) if b else size) - (int(a) if a else 0)
        self.log("storage", request, 206 if a or b else 200, sent if a else size)
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


def serve(root: Path, port: int, storage_port: int, page_size: int, url_ttl: float) -> None:
    """Run the Hub on ``port`` and its storage host on ``storage_port`` until killed."""
    hub = _Hub(root, f"http://127.0.0.1:{storage_port}", page_size, url_ttl)
    api = web.Application()
    api.router.add_route("*", "/{tail:.*}", hub.handle)
    store = web.Application()
    store.router.add_get("/lfs/{sha256}", hub.storage)

    async def main() -> None:
        runners = [web.AppRunner(app, access_log=None) for app in (api, store)]
        for runner, p in zip(runners, (port, storage_port), strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", p).start()
        while True:
            await asyncio.sleep(3600)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


@dataclass(frozen=True)
class HubServer:
    """A running test Hub: ``url`` is what ``HF_ENDPOINT`` is set to."""

    root: Path
    port: int
    storage_port: int
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, host: str = "hub") -> list[tuple[str, str, int, int, str]]:
        """(method, path, status, bytes, auth) of every request to ``host`` (hub|storage)."""
        try:
            lines = (self.root / "access.log").read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            h, method, path, status, size, auth = line.split(" ")
            if h == host:
                out.append((method, path, int(status), int(size), auth))
        return out


@contextlib.contextmanager
def hub_server(
    root: Path | str, *, page_size: int = 1000, url_ttl: float = 3600.0
) -> Iterator[HubServer]:
    """Serve the repos under ``root`` (see ``HubRepos``) on 127.0.0.1; stopped by PID."""
    root = Path(root)
    (root / "objects").mkdir(parents=True, exist_ok=True)
    if not (root / "state.json").exists():
        HubRepos(root)._save()
    storage = free_port()

    def argv(p: int) -> list[str]:
        opts = {"root": str(root), "port": p, "storage_port": storage}
        opts.update(page_size=page_size, url_ttl=url_ttl)
        return [sys.executable, "-m", "preheat.testing.hub", json.dumps(opts)]

    proc, port = start_server(argv, log=root / "server.log", timeout=30, what="test Hub")
    try:
        yield HubServer(root=root, port=port, storage_port=storage, pid=proc.pid)
    finally:
        proc.stop(5)


if __name__ == "__main__":  # one JSON argument: serve()'s keywords
    opts = json.loads(sys.argv[1])
    serve(Path(opts.pop("root")), **opts)
