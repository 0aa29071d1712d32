"""A Hugging Face Hub-protocol server owned by the tests: Starlette + uvicorn, repos as files on disk.

It implements what `huggingface_hub<1.0` uses for `create_repo`, `create_branch`, `create_commit`
(validate-yaml, preupload, the LFS batch API with basic and multipart transfers, the ndjson commit
endpoint), `whoami` (for `login`), `repo_info`/`model_info`, `list_repo_tree`, `list_repo_refs`, `list_repo_commits`,
`hf_hub_download`/`snapshot_download` (resolve HEAD/GET with X-Repo-Commit, ETag, X-Linked-Etag and
X-Linked-Size). The real client talks to it over HTTP through `HF_ENDPOINT`.

Test-only controls live under `/_test/`: `faults` (drop the TCP connection in the middle of an LFS
upload, or of a multipart completion, the next N times) and `stats` (bytes and objects received,
commits made). Commits are atomic: a commit that names an LFS object the server does not hold
whole is refused, and the branch ref moves only when the commit is written.

    HUB_SERVER_TOKEN=secret python -m support.servers.hub_server --root /tmp/hub --port 8765
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import unquote

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
GITATTRIBUTES = (
    "\n".join(
        f"{p} filter=lfs diff=lfs merge=lfs -text"
        for p in (
            "*.safetensors",
            "*.bin",
            "*.pt",
            "*.pth",
            "*.ckpt",
            "*.h5",
            "*.msgpack",
            "*.onnx",
            "*.model",
            "*.npy",
            "*.npz",
            "*.gz",
            "*.zip",
            "*.tar",
            "*.parquet",
            "*.arrow",
        )
    )
    + "\n"
)
REGULAR_MAX = 10 << 20  # larger files go to LFS whatever their name (as on the Hub)
SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHA1 = re.compile(r"^[0-9a-f]{40}$")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}


class HubStorage:
    """Repos, commits, blobs and LFS objects on disk. All mutations happen without awaiting, so
    each request's change is atomic on the single event loop."""

    def __init__(self, root: Path, token: str | None, multipart_threshold: int, chunk_size: int):
        self.root = Path(root)
        for sub in ("repos", "blobs", "lfs", "uploads", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.token = token
        self.secret = secrets.token_bytes(16)
        self.multipart_threshold, self.chunk_size = multipart_threshold, chunk_size
        self.faults: dict[str, int] = {}
        self.stats = {
            "lfs_bytes_received": 0,
            "lfs_objects_stored": 0,
            "lfs_puts": 0,
            "commits": 0,
            "dropped": 0,
            "batch_objects_existing": 0,
            "batch_objects_requested": 0,
        }

    # ---- auth ---------------------------------------------------------------------------------
    def check_auth(self, request, write: bool, repo: dict | None = None) -> None:
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else None
        if given is not None and self.token is not None and not hmac.compare_digest(given, self.token):
            raise HubError(401, "Invalid credentials in Authorization header")
        needs = write or (repo is not None and repo.get("private"))
        if needs and self.token is not None and given is None:
            raise HubError(
                401, "Authorization header is missing: a token is needed", code="RepoNotFound" if not write else None
            )

    def sign(self, what: str) -> str:
        return hmac.new(self.secret, what.encode(), hashlib.sha256).hexdigest()[:32]

    def check_sig(self, what: str, sig: str | None) -> None:
        if not sig or not hmac.compare_digest(self.sign(what), sig):
            raise HubError(403, "bad or missing upload signature")

    # ---- repos --------------------------------------------------------------------------------
    def repo_dir(self, rtype: str, repo_id: str) -> Path:
        return self.root / "repos" / rtype / repo_id

    def load_repo(self, rtype: str, repo_id: str) -> dict:
        path = self.repo_dir(rtype, repo_id) / "repo.json"
        if not path.is_file():
            raise HubError(404, f"Repository Not Found for {rtype}/{repo_id}", code="RepoNotFound")
        return json.loads(path.read_text())

    def save_repo(self, rtype: str, repo_id: str, repo: dict) -> None:
        path = self.repo_dir(rtype, repo_id) / "repo.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(repo, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def create_repo(self, rtype: str, repo_id: str, private: bool) -> bool:
        d = self.repo_dir(rtype, repo_id)
        if (d / "repo.json").is_file():
            return False
        (d / "commits").mkdir(parents=True, exist_ok=True)
        blob = GITATTRIBUTES.encode()
        oid = self.put_blob(blob)
        tree = {".gitattributes": {"size": len(blob), "oid": oid, "lfs": None}}
        sha = self.write_commit(rtype, repo_id, parents=[], tree=tree, title="initial commit", message="")
        self.save_repo(
            rtype,
            repo_id,
            {"id": repo_id, "type": rtype, "private": bool(private), "created_at": _now(), "refs": {"main": sha}},
        )
        return True

    def resolve(self, rtype: str, repo_id: str, repo: dict, revision: str) -> str:
        if revision in repo["refs"]:
            return repo["refs"][revision]
        if revision.startswith("refs/heads/") and revision[11:] in repo["refs"]:
            return repo["refs"][revision[11:]]
        if SHA1.match(revision) and (self.repo_dir(rtype, repo_id) / "commits" / f"{revision}.json").is_file():
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")

    def commit(self, rtype: str, repo_id: str, sha: str) -> dict:
        return json.loads((self.repo_dir(rtype, repo_id) / "commits" / f"{sha}.json").read_text())

    def write_commit(self, rtype: str, repo_id: str, parents: list[str], tree: dict, title: str, message: str) -> str:
        record = {
            "parents": parents,
            "tree": tree,
            "title": title,
            "message": message,
            "date": _now(),
            "authors": [{"user": "tests"}],
        }
        sha = hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()
        record["id"] = sha
        path = self.repo_dir(rtype, repo_id) / "commits" / f"{sha}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)
        return sha

    # ---- content ------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        oid = git_blob_oid(data)
        path = self.root / "blobs" / oid
        if not path.exists():
            path.write_bytes(data)
        return oid

    def lfs_path(self, oid: str) -> Path:
        return self.root / "lfs" / oid

    def has_lfs(self, oid: str, size: int) -> bool:
        path = self.lfs_path(oid)
        return path.is_file() and path.stat().st_size == size

    def file_path(self, entry: dict) -> Path:
        return self.lfs_path(entry["lfs"]["oid"]) if entry.get("lfs") else self.root / "blobs" / entry["oid"]

    def lfs_patterns(self, tree: dict) -> list[str]:
        entry = tree.get(".gitattributes")
        if not entry or entry.get("lfs"):
            return []
        text = (self.root / "blobs" / entry["oid"]).read_text(errors="replace")
        return [line.split()[0] for line in text.splitlines() if "filter=lfs" in line and line.split()]

    def take_fault(self, name: str) -> bool:
        if self.faults.get(name, 0) > 0:
            self.faults[name] -= 1
            self.stats["dropped"] += 1
            return True
        return False


def build_app(storage: HubStorage):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response
    from starlette.routing import Route

    def error_response(exc: HubError) -> Response:
        headers = dict(exc.headers)
        if exc.code:
            headers["X-Error-Code"] = exc.code
        headers["X-Error-Message"] = exc.message
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)

    def segments(request: Request) -> list[str]:
        raw = request.scope.get("raw_path") or request.url.path.encode()
        return [unquote(s) for s in raw.decode().split("?")[0].strip("/").split("/") if s != ""]

    def base(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    def drop_connection(request: Request) -> Response:
        """Abort the TCP connection (RST), as a proxy or a crashing server would."""
        cycle = getattr(request.receive, "__self__", None)
        transport = getattr(cycle, "transport", None)
        if transport is None:
            raise RuntimeError("cannot reach the transport to drop the connection")
        transport.abort()
        return Response(status_code=500)

    async def read_body_to(request: Request, dest: Path, fault: str | None) -> tuple[int, str, str]:
        """Stream the body to `dest`; returns (size, sha256, md5). May drop mid-body."""
        sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
        expected = int(request.headers.get("content-length") or 0)
        armed = fault is not None and storage.take_fault(fault)
        with open(dest, "wb") as f:  # noqa: ASYNC230 - a test server: short local writes; a thread hop per chunk only slows it
            async for chunk in request.stream():
                f.write(chunk)
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
                if armed and size >= max(1, expected // 2):
                    raise _Drop()
        return size, sha.hexdigest(), md5.hexdigest()

    class _Drop(Exception):
        pass

    # ---- API: repos ---------------------------------------------------------------------------
    async def create_repo(request: Request) -> Response:
        storage.check_auth(request, write=True)
        body = await request.json()
        name, org = body.get("name"), body.get("organization")
        rtype = {"model": "models", "dataset": "datasets", "space": "spaces", None: "models"}[body.get("type")]
        if not name or not re.match(r"^[\w.-]+$", name) or (org and not re.match(r"^[\w.-]+$", org)):
            raise HubError(400, f"invalid repo name {org}/{name}")
        repo_id = f"{org}/{name}" if org else f"tests/{name}"
        prefix = "" if rtype == "models" else f"/{rtype}"
        url = f"{base(request)}{prefix}/{repo_id}"
        if not storage.create_repo(rtype, repo_id, bool(body.get("private", False))):
            return JSONResponse({"error": "You already created this model repo", "url": url}, status_code=409)
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    async def validate_yaml(request: Request) -> Response:
        body = await request.json()
        content = body.get("content", "")
        errors = _metadata_errors(content)
        if errors:
            return JSONResponse({"errors": [{"message": m} for m in errors], "warnings": []}, status_code=400)
        return JSONResponse({"errors": [], "warnings": []})

    async def api_repo(request: Request) -> Response:
        seg = segments(request)  # api, <types>, org, name, [verb, ...]
        if len(seg) < 4 or seg[1] not in REPO_TYPES:
            raise HubError(404, "not found")
        rtype, repo_id, rest = seg[1], f"{seg[2]}/{seg[3]}", seg[4:]
        repo = storage.load_repo(rtype, repo_id)
        method = request.method
        verb = rest[0] if rest else None
        if method == "GET" and verb in (None, "revision"):
            storage.check_auth(request, write=False, repo=repo)
            return repo_info(request, rtype, repo_id, repo, rest[1] if len(rest) > 1 else "main")
        if method == "POST" and verb == "preupload":
            storage.check_auth(request, write=True)
            return await preupload(request, rtype, repo_id, repo, rest[1])
        if method == "POST" and verb == "commit":
            storage.check_auth(request, write=True)
            return await commit(request, rtype, repo_id, repo, rest[1])
        if method == "GET" and verb == "tree":
            storage.check_auth(request, write=False, repo=repo)
            return tree(request, rtype, repo_id, repo, rest[1], "/".join(rest[2:]))
        if method == "GET" and verb == "refs":
            storage.check_auth(request, write=False, repo=repo)
            branches = [
                {"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in sorted(repo["refs"].items())
            ]
            return JSONResponse({"branches": branches, "converts": [], "tags": [], "pullRequests": []})
        if method == "GET" and verb == "commits":
            storage.check_auth(request, write=False, repo=repo)
            sha, out = storage.resolve(rtype, repo_id, repo, rest[1]), []
            while sha:
                c = storage.commit(rtype, repo_id, sha)
                out.append(
                    {
                        "id": c["id"],
                        "title": c["title"],
                        "message": c["message"],
                        "authors": c["authors"],
                        "date": c["date"],
                    }
                )
                sha = c["parents"][0] if c["parents"] else None
            return JSONResponse(out)
        if verb == "branch" and len(rest) == 2:
            storage.check_auth(request, write=True)
            branch = rest[1]
            if method == "POST":
                if branch in repo["refs"]:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                body = await request.json() if (await request.body()) else {}
                repo["refs"][branch] = storage.resolve(rtype, repo_id, repo, body.get("startingPoint") or "main")
                storage.save_repo(rtype, repo_id, repo)
                return JSONResponse({})
            if method == "DELETE":
                if branch not in repo["refs"] or branch == "main":
                    raise HubError(404 if branch not in repo["refs"] else 403, f"cannot delete branch {branch}")
                del repo["refs"][branch]
                storage.save_repo(rtype, repo_id, repo)
                return JSONResponse({})
        raise HubError(404, f"no such endpoint: {method} {request.url.path}")

    def repo_info(request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
        sha = storage.resolve(rtype, repo_id, repo, revision)
        c = storage.commit(rtype, repo_id, sha)
        siblings = []
        for path, e in sorted(c["tree"].items()):
            sib = {"rfilename": path, "size": e["size"], "blobId": e["oid"]}
            if e.get("lfs"):
                sib["lfs"] = {"size": e["size"], "sha256": e["lfs"]["oid"], "pointerSize": e["lfs"]["pointerSize"]}
            siblings.append(sib)
        info: dict[str, Any] = {
            "id": repo_id,
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "author": repo_id.split("/")[0],
            "sha": sha,
            "private": repo["private"],
            "disabled": False,
            "gated": False,
            "lastModified": c["date"],
            "createdAt": repo["created_at"],
            "tags": [],
            "downloads": 0,
            "likes": 0,
            "siblings": siblings,
        }
        if "README.md" in c["tree"] and not c["tree"]["README.md"].get("lfs"):
            meta = _front_matter(storage.file_path(c["tree"]["README.md"]).read_text(errors="replace"))
            if isinstance(meta, dict):
                info["cardData"] = meta
                info["tags"] = list(meta.get("tags") or [])
                info["library_name"] = meta.get("library_name")
        return JSONResponse(info)

    async def preupload(request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
        body = await request.json()
        sha = storage.resolve(rtype, repo_id, repo, revision)
        current = storage.commit(rtype, repo_id, sha)["tree"]
        patterns = storage.lfs_patterns(current)
        out = []
        for f in body.get("files", []):
            path, size = f["path"], int(f["size"])
            sample = base64.b64decode(f.get("sample", ""))
            lfs = (
                size > REGULAR_MAX
                or b"\x00" in sample
                or any(fnmatch.fnmatch(path.rsplit("/", 1)[-1], p) or fnmatch.fnmatch(path, p) for p in patterns)
            )
            mode = "lfs" if lfs and size > 0 else "regular"
            entry = current.get(path)
            oid = None
            if entry:
                oid = entry["lfs"]["oid"] if entry.get("lfs") else entry["oid"]
            out.append({"path": path, "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return JSONResponse({"files": out, "commitOid": sha})

    async def commit(request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
        if request.query_params.get("create_pr"):
            raise HubError(400, "pull requests are not supported by the test Hub")
        if revision not in repo["refs"]:
            raise HubError(404, f"Invalid rev id: {revision} (commits go to a branch)", code="RevisionNotFound")
        lines = [json.loads(line) for line in (await request.body()).decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "the first ndjson line must be the header")
        header = lines[0]["value"]
        if not header.get("summary"):
            raise HubError(400, "empty commit summary")
        head = repo["refs"][revision]
        if header.get("parentCommit") and header["parentCommit"] != head:
            raise HubError(
                412,
                f"A commit has happened since. Please refresh and try again. (parent {header['parentCommit']} != head "
                f"{head})",
            )
        tree = dict(storage.commit(rtype, repo_id, head)["tree"])
        for item in lines[1:]:
            key, v = item.get("key"), item.get("value", {})
            path = v.get("path", "")
            if not path or path.startswith("/") or ".." in path.split("/"):
                raise HubError(400, f"invalid path {path!r}")
            if key == "file":
                data = (
                    base64.b64decode(v["content"]) if v.get("encoding", "base64") == "base64" else v["content"].encode()
                )
                tree[path] = {"size": len(data), "oid": storage.put_blob(data), "lfs": None}
            elif key == "lfsFile":
                oid, size = v["oid"], int(v["size"])
                if v.get("algo", "sha256") != "sha256" or not SHA256.match(oid) or not storage.has_lfs(oid, size):
                    raise HubError(
                        422, f"LFS object {oid} ({size} bytes) for {path} was never uploaded whole: commit refused"
                    )
                pointer = lfs_pointer(oid, size)
                tree[path] = {
                    "size": size,
                    "oid": git_blob_oid(pointer),
                    "lfs": {"oid": oid, "pointerSize": len(pointer)},
                }
            elif key == "deletedFile":
                if path not in tree:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", code="EntryNotFound")
                del tree[path]
            elif key == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                for p in [p for p in tree if p.startswith(prefix)]:
                    del tree[p]
            else:
                raise HubError(400, f"unsupported commit operation {key!r}")
        sha = storage.write_commit(rtype, repo_id, [head], tree, header["summary"], header.get("description", ""))
        repo["refs"][revision] = sha  # the only moment the branch changes
        storage.save_repo(rtype, repo_id, repo)
        storage.stats["commits"] += 1
        prefix = "" if rtype == "models" else f"/{rtype}"
        return JSONResponse(
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{base(request)}{prefix}/{repo_id}/commit/{sha}",
                "hookOutput": "",
                "pullRequestUrl": None,
            }
        )

    def tree(request: Request, rtype: str, repo_id: str, repo: dict, revision: str, path: str) -> Response:
        sha = storage.resolve(rtype, repo_id, repo, revision)
        files = storage.commit(rtype, repo_id, sha)["tree"]
        recursive = request.query_params.get("recursive", "false").lower() in ("1", "true")
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        if prefix and not any(p.startswith(prefix) for p in files):
            raise HubError(404, f"{path} does not exist on {revision}", code="EntryNotFound")
        out, dirs = [], set()
        for p, e in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/", 1)[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    dirs.add(prefix + "/".join(parts[:i]))
            entry = {"type": "file", "oid": e["oid"], "size": e["size"], "path": p}
            if e.get("lfs"):
                entry["lfs"] = {"oid": e["lfs"]["oid"], "size": e["size"], "pointerSize": e["lfs"]["pointerSize"]}
            out.append(entry)
        out += [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in sorted(dirs)
        ]
        return JSONResponse(out)

    # ---- resolve ------------------------------------------------------------------------------
    async def resolve_file(request: Request) -> Response:
        seg = segments(request)
        rtype = "models"
        if seg and seg[0] in ("datasets", "spaces"):
            rtype, seg = seg[0], seg[1:]
        if len(seg) < 5 or seg[2] != "resolve":
            raise HubError(404, "not found")
        repo_id, revision, path = f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:])
        repo = storage.load_repo(rtype, repo_id)
        storage.check_auth(request, write=False, repo=repo)
        sha = storage.resolve(rtype, repo_id, repo, revision)
        entry = storage.commit(rtype, repo_id, sha)["tree"].get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", headers={"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["oid"]}"'}
        if entry.get("lfs"):
            headers.update({"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(entry["size"])})
        return FileResponse(storage.file_path(entry), headers=headers, media_type="application/octet-stream")

    # ---- LFS ----------------------------------------------------------------------------------
    async def lfs_batch(request: Request) -> Response:
        seg = segments(request)
        rtype = "models"
        if seg and seg[0] in ("datasets", "spaces"):
            rtype, seg = seg[0], seg[1:]
        repo_id = f"{seg[0]}/{seg[1].removesuffix('.git')}"
        storage.load_repo(rtype, repo_id)
        storage.check_auth(request, write=True)
        body = await request.json()
        if body.get("operation") != "upload":
            raise HubError(400, "only uploads are supported")
        offered = body.get("transfers") or ["basic"]
        multipart_ok = "multipart" in offered
        b, objects, used_multipart = base(request), [], False
        for obj in body.get("objects", []):
            oid, size = obj.get("oid", ""), int(obj.get("size", -1))
            storage.stats["batch_objects_requested"] += 1
            if not SHA256.match(oid) or size < 0:
                objects.append(
                    {"oid": oid, "size": max(size, 0), "error": {"code": 422, "message": "invalid oid or size"}}
                )
                continue
            if storage.has_lfs(oid, size):
                storage.stats["batch_objects_existing"] += 1
                objects.append({"oid": oid, "size": size, "authenticated": True})  # no actions: already there
                continue
            sig = storage.sign(f"{oid}:{size}")
            verify = {"href": f"{b}/_lfs/verify/{oid}", "header": {}}
            if multipart_ok and size > storage.multipart_threshold:
                used_multipart = True
                nparts = math.ceil(size / storage.chunk_size)
                header = {"chunk_size": str(storage.chunk_size)}
                header.update({f"{n:05d}": f"{b}/_lfs/upload/{oid}/{size}/{n}?sig={sig}" for n in range(1, nparts + 1)})
                upload = {"href": f"{b}/_lfs/complete/{oid}/{size}?sig={sig}", "header": header}
            else:
                upload = {"href": f"{b}/_lfs/upload/{oid}/{size}?sig={sig}", "header": {}}
            objects.append(
                {"oid": oid, "size": size, "authenticated": True, "actions": {"upload": upload, "verify": verify}}
            )
        return JSONResponse(
            {"transfer": "multipart" if used_multipart else "basic", "objects": objects, "hash_algo": "sha256"},
            media_type="application/vnd.git-lfs+json",
        )

    async def lfs_upload(request: Request) -> Response:
        seg = segments(request)  # _lfs, upload, oid, size[, part]
        oid, size = seg[2], int(seg[3])
        storage.check_sig(f"{oid}:{size}", request.query_params.get("sig"))
        storage.stats["lfs_puts"] += 1
        if len(seg) == 5:  # one part of a multipart upload
            part = int(seg[4])
            d = storage.root / "uploads" / oid
            d.mkdir(parents=True, exist_ok=True)
            try:
                got, _, md5 = await read_body_to(request, d / f"{part:05d}.tmp", "lfs_put")
            except _Drop:
                return drop_connection(request)
            storage.stats["lfs_bytes_received"] += got
            os.replace(d / f"{part:05d}.tmp", d / f"{part:05d}.part")
            return Response(status_code=200, headers={"ETag": f'"{md5}"'})
        tmp = storage.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
        try:
            try:
                got, sha, _ = await read_body_to(request, tmp, "lfs_put")
            except _Drop:
                return drop_connection(request)
            storage.stats["lfs_bytes_received"] += got
            if got != size or sha != oid:
                raise HubError(400, f"uploaded content has sha256 {sha} and {got} bytes, expected {oid} and {size}")
            os.replace(tmp, storage.lfs_path(oid))
            storage.stats["lfs_objects_stored"] += 1
        finally:
            tmp.unlink(missing_ok=True)
        return Response(status_code=200)

    async def lfs_complete(request: Request) -> Response:
        seg = segments(request)  # _lfs, complete, oid, size
        oid, size = seg[2], int(seg[3])
        storage.check_sig(f"{oid}:{size}", request.query_params.get("sig"))
        body = await request.json()
        if storage.take_fault("lfs_complete"):
            return drop_connection(request)
        d = storage.root / "uploads" / oid
        parts = sorted(body.get("parts", []), key=lambda p: p["partNumber"])
        if not parts or [p["partNumber"] for p in parts] != list(range(1, len(parts) + 1)):
            raise HubError(400, "parts must be numbered 1..N")
        tmp = storage.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
        sha, got = hashlib.sha256(), 0
        try:
            with open(tmp, "wb") as out:  # noqa: ASYNC230 - a test server: joining local part files blocks only this test
                for p in parts:
                    path = d / f"{p['partNumber']:05d}.part"
                    if not path.is_file():
                        raise HubError(400, f"part {p['partNumber']} of {oid} was never received")
                    data = path.read_bytes()
                    if hashlib.md5(data).hexdigest() != p["etag"].strip('"'):
                        raise HubError(400, f"part {p['partNumber']} of {oid}: etag mismatch")
                    out.write(data)
                    sha.update(data)
                    got += len(data)
            if got != size or sha.hexdigest() != oid:
                raise HubError(
                    400, f"assembled object has sha256 {sha.hexdigest()} and {got} bytes, expected {oid} and {size}"
                )
            os.replace(tmp, storage.lfs_path(oid))
            storage.stats["lfs_objects_stored"] += 1
            shutil.rmtree(d, ignore_errors=True)
        finally:
            tmp.unlink(missing_ok=True)
        return JSONResponse({})

    async def lfs_verify(request: Request) -> Response:
        storage.check_auth(request, write=True)
        body = await request.json()
        if not storage.has_lfs(body.get("oid", ""), int(body.get("size", -1))):
            raise HubError(404, f"LFS object {body.get('oid')} is not stored")
        return JSONResponse({})

    async def whoami(request: Request) -> Response:
        """What `huggingface_hub.login` asks before it saves a token: who the token belongs to."""
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HubError(401, "Authorization header is missing: a token is needed")
        storage.check_auth(request, write=True)
        return JSONResponse(
            {
                "type": "user",
                "name": "test-user",
                "auth": {"type": "access_token", "accessToken": {"displayName": "test-token", "role": "write"}},
            }
        )

    # ---- test controls --------------------------------------------------------------------------
    async def test_faults(request: Request) -> Response:
        storage.faults = {k: int(v) for k, v in (await request.json()).items()}
        return JSONResponse(storage.faults)

    async def test_stats(request: Request) -> Response:
        return JSONResponse({**storage.stats, "faults": storage.faults})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    def guarded(fn):
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except HubError as exc:
                return error_response(exc)

        return endpoint

    routes = [
        Route("/_test/health", guarded(health), methods=["GET"]),
        Route("/_test/faults", guarded(test_faults), methods=["POST"]),
        Route("/_test/stats", guarded(test_stats), methods=["GET"]),
        Route("/_lfs/upload/{rest:path}", guarded(lfs_upload), methods=["PUT"]),
        Route("/_lfs/complete/{rest:path}", guarded(lfs_complete), methods=["POST"]),
        Route("/_lfs/verify/{rest:path}", guarded(lfs_verify), methods=["POST"]),
        Route("/api/repos/create", guarded(create_repo), methods=["POST"]),
        Route("/api/validate-yaml", guarded(validate_yaml), methods=["POST"]),
        Route("/api/whoami-v2", guarded(whoami), methods=["GET"]),
        Route("/api/{rest:path}", guarded(api_repo), methods=["GET", "POST", "DELETE"]),
        Route("/{rest:path}.git/info/lfs/objects/batch", guarded(lfs_batch), methods=["POST"]),
        Route("/{rest:path}", guarded(resolve_file), methods=["GET", "HEAD"]),
    ]
    return Starlette(routes=routes)


def _front_matter(text: str) -> Any:
    import yaml

    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.DOTALL)
    if not m:
        return None
    return yaml.safe_load(m.group(1))


def _metadata_errors(content: str) -> list[str]:
    try:
        meta = _front_matter(content)
    except Exception as exc:
        return [f"YAML metadata is not valid YAML: {exc}"]
    if meta is None:
        return []
    if not isinstance(meta, dict):
        return ["YAML metadata must be a mapping"]
    errors = []
    for key in ("license", "library_name", "pipeline_tag"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    for key in ("tags", "datasets", "language", "base_model"):
        v = meta.get(key)
        if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            errors.append(f'"{key}" must be a string or a list of strings')
    return errors


class HubServer:
    """The server as a subprocess, started and stopped by PID, plus its test controls."""

    def __init__(self, root: Path, token: str, multipart_threshold: int = 1 << 20, chunk_size: int = 512 << 10):
        from support.servers.seaweed import free_ports

        self.root, self.token = Path(root), token
        self.port = free_ports(1)[0]
        self.multipart_threshold, self.chunk_size = multipart_threshold, chunk_size
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> HubServer:
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HUB_SERVER_TOKEN": self.token}
        repo = Path(__file__).resolve().parents[2]
        env["PYTHONPATH"] = f"{repo}{os.pathsep}{env.get('PYTHONPATH', '')}"
        with open(self.root / "server.log", "ab") as log:  # the server keeps its own copy of the handle
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "support.servers.hub_server",
                    "--root",
                    str(self.root / "data"),
                    "--port",
                    str(self.port),
                    "--multipart-threshold",
                    str(self.multipart_threshold),
                    "--chunk-size",
                    str(self.chunk_size),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(repo),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"hub server exited with {self.proc.returncode}: {(self.root / 'server.log').read_text()[-2000:]}"
                )
            try:
                urllib.request.urlopen(f"{self.endpoint}/_test/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("hub server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _call(self, path: str, body: dict | None = None) -> Any:
        req = urllib.request.Request(
            f"{self.endpoint}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def set_faults(self, **faults: int) -> dict:
        """e.g. set_faults(lfs_put=1): drop the next LFS upload mid-body; lfs_complete=N: drop N completions."""
        return self._call("/_test/faults", faults)

    def stats(self) -> dict:
        return self._call("/_test/stats")


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--multipart-threshold", type=int, default=1 << 20)
    p.add_argument("--chunk-size", type=int, default=512 << 10)
    a = p.parse_args(argv)
    storage = HubStorage(Path(a.root), os.environ.get("HUB_SERVER_TOKEN") or None, a.multipart_threshold, a.chunk_size)
    uvicorn.run(build_app(storage), host="127.0.0.1", port=a.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
