"""The Hub-protocol server's storage: repos, commits, blobs and LFS objects as files on disk.

    python -c "from support.servers.hub_storage import git_blob_oid; print(git_blob_oid(b'x'))"

Commits are atomic: a commit that names an LFS object the server does not hold whole is refused,
and the branch ref moves only when the commit is written (support/servers/hub_routes.py serves it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

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


def front_matter(text: str) -> Any:
    import yaml

    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.DOTALL)
    if not m:
        return None
    return yaml.safe_load(m.group(1))


def metadata_errors(content: str) -> list[str]:
    try:
        meta = front_matter(content)
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
