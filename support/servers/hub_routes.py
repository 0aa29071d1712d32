"""The Hub-protocol server's endpoints (support/servers/hub_server.py), in route groups on one storage.

    HUB_SERVER_TOKEN=secret python -m support.servers.hub_server --root /tmp/hub --port 8765

`RepoRoutes`: the repo API (create, validate-yaml, info, preupload, commit, tree, refs, commits,
branches); `FileRoutes`: downloads (resolve) and the LFS batch API with basic and multipart uploads;
`AccountRoutes`: whoami and the test-only controls under `/_test/`. `build_app` puts them in the order
Starlette matches them, the catch-all download route last.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import math
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from support.servers.hub_storage import (
    REGULAR_MAX,
    REPO_TYPES,
    SHA256,
    HubError,
    HubStorage,
    front_matter,
    git_blob_oid,
    lfs_pointer,
    metadata_errors,
)


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


class Drop(Exception):
    pass


class Handlers:
    """What every route group shares: the storage, and the body streamed to disk (where a fault may drop it)."""

    def __init__(self, storage: HubStorage):
        self.storage = storage

    async def read_body_to(self, request: Request, dest: Path, fault: str | None) -> tuple[int, str, str]:
        """Stream the body to `dest`; returns (size, sha256, md5). May drop mid-body."""
        sha, md5, size = hashlib.sha256(), hashlib.md5(), 0
        expected = int(request.headers.get("content-length") or 0)
        armed = fault is not None and self.storage.take_fault(fault)
        with open(dest, "wb") as f:  # noqa: ASYNC230 - a test server: short local writes; a thread hop per chunk only slows it
            async for chunk in request.stream():
                f.write(chunk)
                sha.update(chunk)
                md5.update(chunk)
                size += len(chunk)
                if armed and size >= max(1, expected // 2):
                    raise Drop()
        return size, sha.hexdigest(), md5.hexdigest()


def guarded(fn):
    """The endpoint of a handler: a HubError becomes the Hub's error response."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except HubError as exc:
            return error_response(exc)

    return endpoint


class RepoRoutes(Handlers):
    """The repo API under /api: create, validate-yaml, info, preupload, commit, tree, refs, commits, branches."""

    async def create_repo(self, request: Request) -> Response:
        self.storage.check_auth(request, write=True)
        body = await request.json()
        name, org = body.get("name"), body.get("organization")
        rtype = {"model": "models", "dataset": "datasets", "space": "spaces", None: "models"}[body.get("type")]
        if not name or not re.match(r"^[\w.-]+$", name) or (org and not re.match(r"^[\w.-]+$", org)):
            raise HubError(400, f"invalid repo name {org}/{name}")
        repo_id = f"{org}/{name}" if org else f"tests/{name}"
        prefix = "" if rtype == "models" else f"/{rtype}"
        url = f"{base(request)}{prefix}/{repo_id}"
        if not self.storage.create_repo(rtype, repo_id, bool(body.get("private", False))):
            return JSONResponse({"error": "You already created this model repo", "url": url}, status_code=409)
        return JSONResponse({"url": url, "name": repo_id, "id": repo_id})

    async def validate_yaml(self, request: Request) -> Response:
        body = await request.json()
        content = body.get("content", "")
        errors = metadata_errors(content)
        if errors:
            return JSONResponse({"errors": [{"message": m} for m in errors], "warnings": []}, status_code=400)
        return JSONResponse({"errors": [], "warnings": []})

    async def api_repo(self, request: Request) -> Response:
        seg = segments(request)  # api, <types>, org, name, [verb, ...]
        if len(seg) < 4 or seg[1] not in REPO_TYPES:
            raise HubError(404, "not found")
        rtype, repo_id, rest = seg[1], f"{seg[2]}/{seg[3]}", seg[4:]
        repo = self.storage.load_repo(rtype, repo_id)
        method = request.method
        verb = rest[0] if rest else None
        if method == "GET" and verb in (None, "revision"):
            self.storage.check_auth(request, write=False, repo=repo)
            return self.repo_info(request, rtype, repo_id, repo, rest[1] if len(rest) > 1 else "main")
        if method == "POST" and verb == "preupload":
            self.storage.check_auth(request, write=True)
            return await self.preupload(request, rtype, repo_id, repo, rest[1])
        if method == "POST" and verb == "commit":
            self.storage.check_auth(request, write=True)
            return await self.commit(request, rtype, repo_id, repo, rest[1])
        if method == "GET" and verb == "tree":
            self.storage.check_auth(request, write=False, repo=repo)
            return self.tree(request, rtype, repo_id, repo, rest[1], "/".join(rest[2:]))
        if method == "GET" and verb == "refs":
            self.storage.check_auth(request, write=False, repo=repo)
            branches = [
                {"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in sorted(repo["refs"].items())
            ]
            return JSONResponse({"branches": branches, "converts": [], "tags": [], "pullRequests": []})
        if method == "GET" and verb == "commits":
            self.storage.check_auth(request, write=False, repo=repo)
            sha, out = self.storage.resolve(rtype, repo_id, repo, rest[1]), []
            while sha:
                c = self.storage.commit(rtype, repo_id, sha)
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
            self.storage.check_auth(request, write=True)
            branch = rest[1]
            if method == "POST":
                if branch in repo["refs"]:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                body = await request.json() if (await request.body()) else {}
                repo["refs"][branch] = self.storage.resolve(rtype, repo_id, repo, body.get("startingPoint") or "main")
                self.storage.save_repo(rtype, repo_id, repo)
                return JSONResponse({})
            if method == "DELETE":
                if branch not in repo["refs"] or branch == "main":
                    raise HubError(404 if branch not in repo["refs"] else 403, f"cannot delete branch {branch}")
                del repo["refs"][branch]
                self.storage.save_repo(rtype, repo_id, repo)
                return JSONResponse({})
        raise HubError(404, f"no such endpoint: {method} {request.url.path}")

    def repo_info(self, request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
        sha = self.storage.resolve(rtype, repo_id, repo, revision)
        c = self.storage.commit(rtype, repo_id, sha)
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
            meta = front_matter(self.storage.file_path(c["tree"]["README.md"]).read_text(errors="replace"))
            if isinstance(meta, dict):
                info["cardData"] = meta
                info["tags"] = list(meta.get("tags") or [])
                info["library_name"] = meta.get("library_name")
        return JSONResponse(info)

    async def preupload(self, request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
        body = await request.json()
        sha = self.storage.resolve(rtype, repo_id, repo, revision)
        current = self.storage.commit(rtype, repo_id, sha)["tree"]
        patterns = self.storage.lfs_patterns(current)
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

    async def commit(self, request: Request, rtype: str, repo_id: str, repo: dict, revision: str) -> Response:
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
        tree = dict(self.storage.commit(rtype, repo_id, head)["tree"])
        for item in lines[1:]:
            key, v = item.get("key"), item.get("value", {})
            path = v.get("path", "")
            if not path or path.startswith("/") or ".." in path.split("/"):
                raise HubError(400, f"invalid path {path!r}")
            if key == "file":
                data = (
                    base64.b64decode(v["content"]) if v.get("encoding", "base64") == "base64" else v["content"].encode()
                )
                tree[path] = {"size": len(data), "oid": self.storage.put_blob(data), "lfs": None}
            elif key == "lfsFile":
                oid, size = v["oid"], int(v["size"])
                if v.get("algo", "sha256") != "sha256" or not SHA256.match(oid) or not self.storage.has_lfs(oid, size):
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
        sha = self.storage.write_commit(rtype, repo_id, [head], tree, header["summary"], header.get("description", ""))
        repo["refs"][revision] = sha  # the only moment the branch changes
        self.storage.save_repo(rtype, repo_id, repo)
        self.storage.stats["commits"] += 1
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

    def tree(self, request: Request, rtype: str, repo_id: str, repo: dict, revision: str, path: str) -> Response:
        sha = self.storage.resolve(rtype, repo_id, repo, revision)
        files = self.storage.commit(rtype, repo_id, sha)["tree"]
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


class FileRoutes(Handlers):
    """Downloads (resolve, with the Hub's X-Repo-Commit / ETag / X-Linked-* headers) and LFS uploads."""

    async def resolve_file(self, request: Request) -> Response:
        seg = segments(request)
        rtype = "models"
        if seg and seg[0] in ("datasets", "spaces"):
            rtype, seg = seg[0], seg[1:]
        if len(seg) < 5 or seg[2] != "resolve":
            raise HubError(404, "not found")
        repo_id, revision, path = f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:])
        repo = self.storage.load_repo(rtype, repo_id)
        self.storage.check_auth(request, write=False, repo=repo)
        sha = self.storage.resolve(rtype, repo_id, repo, revision)
        entry = self.storage.commit(rtype, repo_id, sha)["tree"].get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", headers={"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["oid"]}"'}
        if entry.get("lfs"):
            headers.update({"X-Linked-Etag": f'"{entry["lfs"]["oid"]}"', "X-Linked-Size": str(entry["size"])})
        return FileResponse(self.storage.file_path(entry), headers=headers, media_type="application/octet-stream")

    async def lfs_batch(self, request: Request) -> Response:
        seg = segments(request)
        rtype = "models"
        if seg and seg[0] in ("datasets", "spaces"):
            rtype, seg = seg[0], seg[1:]
        repo_id = f"{seg[0]}/{seg[1].removesuffix('.git')}"
        self.storage.load_repo(rtype, repo_id)
        self.storage.check_auth(request, write=True)
        body = await request.json()
        if body.get("operation") != "upload":
            raise HubError(400, "only uploads are supported")
        offered = body.get("transfers") or ["basic"]
        multipart_ok = "multipart" in offered
        b, objects, used_multipart = base(request), [], False
        for obj in body.get("objects", []):
            oid, size = obj.get("oid", ""), int(obj.get("size", -1))
            self.storage.stats["batch_objects_requested"] += 1
            if not SHA256.match(oid) or size < 0:
                objects.append(
                    {"oid": oid, "size": max(size, 0), "error": {"code": 422, "message": "invalid oid or size"}}
                )
                continue
            if self.storage.has_lfs(oid, size):
                self.storage.stats["batch_objects_existing"] += 1
                objects.append({"oid": oid, "size": size, "authenticated": True})  # no actions: already there
                continue
            sig = self.storage.sign(f"{oid}:{size}")
            verify = {"href": f"{b}/_lfs/verify/{oid}", "header": {}}
            if multipart_ok and size > self.storage.multipart_threshold:
                used_multipart = True
                nparts = math.ceil(size / self.storage.chunk_size)
                header = {"chunk_size": str(self.storage.chunk_size)}
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

    async def lfs_upload(self, request: Request) -> Response:
        seg = segments(request)  # _lfs, upload, oid, size[, part]
        oid, size = seg[2], int(seg[3])
        self.storage.check_sig(f"{oid}:{size}", request.query_params.get("sig"))
        self.storage.stats["lfs_puts"] += 1
        if len(seg) == 5:  # one part of a multipart upload
            part = int(seg[4])
            d = self.storage.root / "uploads" / oid
            d.mkdir(parents=True, exist_ok=True)
            try:
                got, _, md5 = await self.read_body_to(request, d / f"{part:05d}.tmp", "lfs_put")
            except Drop:
                return drop_connection(request)
            self.storage.stats["lfs_bytes_received"] += got
            os.replace(d / f"{part:05d}.tmp", d / f"{part:05d}.part")
            return Response(status_code=200, headers={"ETag": f'"{md5}"'})
        tmp = self.storage.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
        try:
            try:
                got, sha, _ = await self.read_body_to(request, tmp, "lfs_put")
            except Drop:
                return drop_connection(request)
            self.storage.stats["lfs_bytes_received"] += got
            if got != size or sha != oid:
                raise HubError(400, f"uploaded content has sha256 {sha} and {got} bytes, expected {oid} and {size}")
            os.replace(tmp, self.storage.lfs_path(oid))
            self.storage.stats["lfs_objects_stored"] += 1
        finally:
            tmp.unlink(missing_ok=True)
        return Response(status_code=200)

    async def lfs_complete(self, request: Request) -> Response:
        seg = segments(request)  # _lfs, complete, oid, size
        oid, size = seg[2], int(seg[3])
        self.storage.check_sig(f"{oid}:{size}", request.query_params.get("sig"))
        body = await request.json()
        if self.storage.take_fault("lfs_complete"):
            return drop_connection(request)
        d = self.storage.root / "uploads" / oid
        parts = sorted(body.get("parts", []), key=lambda p: p["partNumber"])
        if not parts or [p["partNumber"] for p in parts] != list(range(1, len(parts) + 1)):
            raise HubError(400, "parts must be numbered 1..N")
        tmp = self.storage.root / "tmp" / f"{oid}.{secrets.token_hex(4)}"
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
            os.replace(tmp, self.storage.lfs_path(oid))
            self.storage.stats["lfs_objects_stored"] += 1
            shutil.rmtree(d, ignore_errors=True)
        finally:
            tmp.unlink(missing_ok=True)
        return JSONResponse({})

    async def lfs_verify(self, request: Request) -> Response:
        self.storage.check_auth(request, write=True)
        body = await request.json()
        if not self.storage.has_lfs(body.get("oid", ""), int(body.get("size", -1))):
            raise HubError(404, f"LFS object {body.get('oid')} is not stored")
        return JSONResponse({})


class AccountRoutes(Handlers):
    """whoami (what `login` asks) and the test-only controls under /_test/."""

    async def whoami(self, request: Request) -> Response:
        """What `huggingface_hub.login` asks before it saves a token: who the token belongs to."""
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HubError(401, "Authorization header is missing: a token is needed")
        self.storage.check_auth(request, write=True)
        return JSONResponse(
            {
                "type": "user",
                "name": "test-user",
                "auth": {"type": "access_token", "accessToken": {"displayName": "test-token", "role": "write"}},
            }
        )

    async def test_faults(self, request: Request) -> Response:
        self.storage.faults = {k: int(v) for k, v in (await request.json()).items()}
        return JSONResponse(self.storage.faults)

    async def test_stats(self, request: Request) -> Response:
        return JSONResponse({**self.storage.stats, "faults": self.storage.faults})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": True})


def build_app(storage: HubStorage) -> Starlette:
    repos, files, account = RepoRoutes(storage), FileRoutes(storage), AccountRoutes(storage)
    routes = [
        Route("/_test/health", guarded(account.health), methods=["GET"]),
        Route("/_test/faults", guarded(account.test_faults), methods=["POST"]),
        Route("/_test/stats", guarded(account.test_stats), methods=["GET"]),
        Route("/_lfs/upload/{rest:path}", guarded(files.lfs_upload), methods=["PUT"]),
        Route("/_lfs/complete/{rest:path}", guarded(files.lfs_complete), methods=["POST"]),
        Route("/_lfs/verify/{rest:path}", guarded(files.lfs_verify), methods=["POST"]),
        Route("/api/repos/create", guarded(repos.create_repo), methods=["POST"]),
        Route("/api/validate-yaml", guarded(repos.validate_yaml), methods=["POST"]),
        Route("/api/whoami-v2", guarded(account.whoami), methods=["GET"]),
        Route("/api/{rest:path}", guarded(repos.api_repo), methods=["GET", "POST", "DELETE"]),
        Route("/{rest:path}.git/info/lfs/objects/batch", guarded(files.lfs_batch), methods=["POST"]),
        Route("/{rest:path}", guarded(files.resolve_file), methods=["GET", "HEAD"]),
    ]
    return Starlette(routes=routes)
