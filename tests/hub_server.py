"""A local hub-protocol TEST SERVER for quantkit's push/pull tests. Not a hub: no persistence, one token.

It implements only the endpoints huggingface_hub 1.33's client calls for `create_repo`, `create_branch`,
`upload_folder` over plain LFS (`HF_HUB_DISABLE_XET=1`), `repo_info`, `list_repo_tree`,
`hf_hub_download` / `snapshot_download`:

    POST /api/repos/create                               create a repo (409 when it exists)
    POST /api/models/{repo}/branch/{branch}              create a branch from main
    POST /api/validate-yaml                              README front matter must be YAML
    POST /api/models/{repo}/preupload/{rev}              upload mode per file (lfs / regular) + remote oid
    POST /{repo}.git/info/lfs/objects/batch              LFS batch: upload URL per missing object
    PUT  /lfs-upload/{oid}?sig=...                       basic transfer; self-authorising URL (no token sent)
    POST /api/models/{repo}/commit/{rev}                 ndjson commit (header, file, lfsFile, deletedFile)
    GET  /api/models/{repo}[/revision/{rev}]             repo info (sha, siblings)
    GET  /api/models/{repo}/tree/{rev}[/{path}]          file list with size, blob id and LFS oid
    HEAD/GET /{repo}/resolve/{rev}/{path}                regular files inline; LFS files redirect with
                                                         X-Linked-Etag / X-Linked-Size to /lfs-objects/{oid}
    GET  /lfs-objects/{oid}?commit=...                   LFS content, with Range (resumed downloads); on the
                                                         same host, so it repeats the X-Repo-Commit/X-Linked-*

Writes need `Authorization: Bearer <token>`; an uploaded object is kept only when its bytes hash to the
announced sha256 (a killed upload leaves nothing). Every request is recorded in `requests`, every
commit in `commits`, every completed LFS PUT in `lfs_puts`, for the tests to assert on.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".pkl")


@dataclass
class StoredFile:
    size: int
    blob_id: str  # git blob sha1 of the content (regular) or of the LFS pointer (lfs)
    lfs_oid: str | None  # sha256 of the content for LFS files
    content: bytes | None  # regular files only; LFS content lives in the object store


@dataclass
class Repo:
    private: bool
    refs: dict[str, str] = field(default_factory=dict)  # "main", "refs/pr/1" -> commit oid
    commits: dict[str, dict[str, StoredFile]] = field(default_factory=dict)


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


class HubTestServer:
    """Start with `with HubTestServer(tmp_path, token) as hub:`; `hub.url` is the endpoint."""

    def __init__(self, store: Path, token: str) -> None:
        self.store = store
        self.token = token
        self.serial_puts = threading.Lock()  # one LFS PUT at a time: a kill leaves a clean boundary
        # With `hold_puts_after = n`, the LFS PUT that comes after n completed ones waits, mid-upload, until
        # `release` is set (`holding` says it is waiting): a client killed then has uploaded exactly n objects.
        self.hold_puts_after: int | None = None
        self.holding = threading.Event()
        self.release = threading.Event()
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict[str, object]] = []
        self.lfs_puts: list[str] = []
        self.headers_seen: list[str] = []
        self._lock = threading.Lock()
        self._secret = hashlib.sha256(token.encode() + b"sig").digest()
        (store / "objects").mkdir(parents=True, exist_ok=True)
        self._httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubTestServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- state helpers for tests ----------------------------------------------------------------
    def object_path(self, oid: str) -> Path:
        return self.store / "objects" / oid

    def has_object(self, oid: str) -> bool:
        return self.object_path(oid).exists()

    def seed(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> str:
        """Create `repo_id` holding `files` (server side, as if pushed earlier); returns the commit."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo(private))
            tree: dict[str, StoredFile] = {}
            for path, content in files.items():
                if path.endswith(LFS_SUFFIXES):
                    oid = hashlib.sha256(content).hexdigest()
                    self.object_path(oid).write_bytes(content)
                    tree[path] = StoredFile(len(content), git_blob_id(lfs_pointer(oid, len(content))), oid, None)
                else:
                    tree[path] = StoredFile(len(content), git_blob_id(content), None, content)
            return self._new_commit(repo, "main", tree, "seed")

    def head_files(self, repo_id: str, ref: str = "main") -> dict[str, StoredFile]:
        repo = self.repos[repo_id]
        return repo.commits[repo.refs[ref]]

    def read(self, entry: StoredFile) -> bytes:
        return entry.content if entry.content is not None else self.object_path(str(entry.lfs_oid)).read_bytes()

    def _new_commit(self, repo: Repo, ref: str, tree: dict[str, StoredFile], message: str) -> str:
        parent = repo.refs.get(ref, "")
        oid = hashlib.sha1(f"{parent}:{message}:{time.time_ns()}:{sorted(tree)}".encode()).hexdigest()
        repo.commits[oid] = tree
        repo.refs[ref] = oid
        return oid

    def sign(self, oid: str) -> str:
        return hmac.new(self._secret, oid.encode(), "sha256").hexdigest()


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client killed mid-request (the resume test) is expected, not an error


def _handler(hub: HubTestServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: object) -> None:  # quiet
            pass

        # ---- plumbing ---------------------------------------------------------------------------
        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().strip().split(b";")[0], 16)
                    if size == 0:
                        self.rfile.readline()
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  content_type: str = "application/json", head: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, value: object, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(value).encode(), headers)

        def _error(self, status: int, message: str) -> None:
            self._json(status, {"error": message}, {"X-Error-Message": message})

        def _authorized(self) -> bool:
            return self.headers.get("Authorization", "") == f"Bearer {hub.token}"

        def _record(self) -> tuple[list[str], dict[str, list[str]]]:
            parts = urlsplit(self.path)
            hub.requests.append((self.command, parts.path))
            hub.headers_seen.append(str(self.headers))
            return [unquote(s) for s in parts.path.split("/")[1:]], parse_qs(parts.query)

        def _repo(self, repo_id: str, write: bool) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or ((write or repo.private) and not self._authorized()):
                status = 401 if not self._authorized() else 404
                self._send(status, b'{"error":"Repository not found"}',
                           {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
                return None
            return repo

        def _commit_of(self, repo: Repo, rev: str) -> str | None:
            if rev in repo.refs:
                return repo.refs[rev]
            matches = [c for c in repo.commits if c.startswith(rev)] if len(rev) >= 7 else []
            if len(matches) == 1:
                return matches[0]
            self._send(404, b'{"error":"Revision not found"}',
                       {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
            return None

        def _readable(self, repo_id: str, rev: str) -> tuple[Repo, str] | None:
            """(repo, commit) for a read at `rev`; None once the error response is sent."""
            repo = self._repo(repo_id, write=False)
            commit = self._commit_of(repo, rev) if repo is not None else None
            return (repo, commit) if repo is not None and commit is not None else None

        # ---- verbs ------------------------------------------------------------------------------
        def do_POST(self) -> None:  # noqa: N802
            seg, query = self._record()
            body = self._body()
            if seg[:3] == ["api", "repos", "create"]:
                return self._create_repo(json.loads(body))
            if seg == ["api", "validate-yaml"]:
                return self._validate_yaml(json.loads(body))
            if len(seg) == 6 and seg[2:] == ["info", "lfs", "objects", "batch"]:
                return self._lfs_batch("/".join(seg[:2]).removesuffix(".git"), json.loads(body))
            if seg[:2] == ["api", "models"] and len(seg) >= 6:
                repo_id, action, rev = f"{seg[2]}/{seg[3]}", seg[4], "/".join(seg[5:])
                if action == "preupload":
                    return self._preupload(repo_id, rev, json.loads(body))
                if action == "commit":
                    return self._commit(repo_id, rev, body, "create_pr" in query)
                if action == "branch":
                    return self._branch(repo_id, rev)
            self._error(404, f"no such endpoint: POST {self.path}")

        def do_PUT(self) -> None:  # noqa: N802
            seg, query = self._record()
            if seg[:1] != ["lfs-upload"] or len(seg) != 2:
                return self._error(404, "no such endpoint")
            oid = seg[1]
            if not hmac.compare_digest(query.get("sig", [""])[0], hub.sign(oid)):
                return self._error(403, "bad upload signature")
            with hub.serial_puts:
                if hub.hold_puts_after is not None and len(hub.lfs_puts) >= hub.hold_puts_after:
                    hub.holding.set()
                    hub.release.wait(timeout=600)
                self._receive_object(oid)

        def _receive_object(self, oid: str) -> None:
            tmp = hub.object_path(oid).with_suffix(f".incoming-{threading.get_ident()}")
            digest = hashlib.sha256()
            remaining = int(self.headers.get("Content-Length") or -1)
            chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
            with open(tmp, "wb") as fh:
                if chunked:
                    data = self._body()
                    fh.write(data)
                    digest.update(data)
                else:
                    while remaining > 0:
                        try:
                            chunk = self.rfile.read(min(65536, remaining))
                        except OSError:
                            chunk = b""
                        if not chunk:
                            break  # client went away: keep nothing
                        fh.write(chunk)
                        digest.update(chunk)
                        remaining -= len(chunk)
            if remaining > 0 or digest.hexdigest() != oid:
                tmp.unlink(missing_ok=True)
                return self._error(400, "uploaded bytes do not match the announced sha256")
            tmp.replace(hub.object_path(oid))
            hub.lfs_puts.append(oid)
            self._send(200, b"{}")

        def do_HEAD(self) -> None:  # noqa: N802
            self._get(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._get(head=False)

        def _get(self, head: bool) -> None:
            seg, query = self._record()
            if seg[:1] == ["lfs-objects"] and len(seg) == 2:
                return self._serve_object(seg[1], query.get("commit", [""])[0], head)
            if seg[:2] == ["api", "models"] and len(seg) == 4:
                return self._repo_info(f"{seg[2]}/{seg[3]}", "main")
            if seg[:2] == ["api", "models"] and len(seg) >= 6:
                repo_id, action = f"{seg[2]}/{seg[3]}", seg[4]
                if action == "revision":
                    return self._repo_info(repo_id, seg[5])
                if action == "tree":
                    return self._tree(repo_id, seg[5], "/".join(seg[6:]), query)
            if len(seg) >= 5 and seg[2] == "resolve":
                return self._resolve(f"{seg[0]}/{seg[1]}", seg[3], "/".join(seg[4:]), head)
            self._error(404, f"no such endpoint: GET {self.path}")

        # ---- endpoints --------------------------------------------------------------------------
        def _create_repo(self, payload: dict[str, object]) -> None:
            if not self._authorized():
                return self._error(401, "Invalid credentials in Authorization header")
            org = payload.get("organization")
            repo_id = f"{org}/{payload['name']}" if org else f"user/{payload['name']}"
            with hub._lock:
                if repo_id in hub.repos:
                    return self._json(409, {"error": "You already created this model repo",
                                            "url": f"{hub.url}/{repo_id}"})
                repo = hub.repos[repo_id] = Repo(payload.get("visibility") == "private" or bool(payload.get("private")))
                attrs = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
                hub._new_commit(repo, "main", {".gitattributes": StoredFile(len(attrs), git_blob_id(attrs), None,
                                                                            attrs)}, "initial commit")
            self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _branch(self, repo_id: str, branch: str) -> None:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return
            if branch in repo.refs:
                return self._error(409, "Reference already exists")
            repo.refs[branch] = repo.refs["main"]
            self._json(200, {})

        def _validate_yaml(self, payload: dict[str, str]) -> None:
            content = payload.get("content", "")
            if content.startswith("---\n"):
                try:
                    meta = yaml.safe_load(content[4:content.index("\n---", 4)])
                    assert isinstance(meta, dict)
                except Exception:
                    return self._json(400, {"errors": [{"message": "front matter is not a YAML mapping"}]})
            self._json(200, {"errors": [], "warnings": []})

        def _preupload(self, repo_id: str, rev: str, payload: dict[str, list[dict[str, object]]]) -> None:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return
            current = repo.commits[repo.refs.get(rev, repo.refs["main"])]
            files = []
            for f in payload["files"]:
                path = str(f["path"])
                lfs = path.endswith(LFS_SUFFIXES) or int(str(f["size"])) > 10_000_000
                old = current.get(path)
                oid = (old.lfs_oid if lfs else old.blob_id) if old else None
                files.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                              "oid": oid})
            self._json(200, {"files": files, "commitOid": repo.refs.get(rev)})

        def _lfs_batch(self, repo_id: str, payload: dict[str, list[dict[str, object]]]) -> None:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return
            objects = []
            for obj in payload["objects"]:
                oid, size = str(obj["oid"]), int(str(obj["size"]))
                entry: dict[str, object] = {"oid": oid, "size": size, "authenticated": True}
                if not hub.has_object(oid):
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{oid}?sig={hub.sign(oid)}"}}
                objects.append(entry)
            self._json(200, {"transfer": "basic", "objects": objects})

        def _commit(self, repo_id: str, rev: str, body: bytes, create_pr: bool) -> None:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            with hub._lock:
                base = repo.refs.get(rev)
                if base is None:
                    return self._error(404, f"Invalid rev id: {rev}")
                tree = dict(repo.commits[base])
                header = {}
                for item in lines:
                    key, value = item["key"], item["value"]
                    if key == "header":
                        header = value
                    elif key == "file":
                        content = base64.b64decode(value["content"])
                        tree[value["path"]] = StoredFile(len(content), git_blob_id(content), None, content)
                    elif key == "lfsFile":
                        oid = value["oid"]
                        if not hub.has_object(oid):
                            return self._error(422, f"LFS object {oid} was never uploaded")
                        size = hub.object_path(oid).stat().st_size
                        tree[value["path"]] = StoredFile(size, git_blob_id(lfs_pointer(oid, size)), oid, None)
                    elif key == "deletedFile":
                        tree.pop(value["path"], None)
                    else:
                        return self._error(400, f"unsupported commit operation {key}")
                ref = rev
                pr_url = None
                if create_pr:
                    number = 1 + sum(r.startswith("refs/pr/") for r in repo.refs)
                    ref = f"refs/pr/{number}"
                    repo.refs[ref] = base
                    pr_url = f"{hub.url}/{repo_id}/discussions/{number}"
                oid = hub._new_commit(repo, ref, tree, str(header.get("summary", "")))
                hub.commits.append({"repo": repo_id, "ref": ref, "oid": oid, "summary": header.get("summary"),
                                    "files": sorted(tree)})
            self._json(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": pr_url, "success": True})

        def _repo_info(self, repo_id: str, rev: str) -> None:
            found = self._readable(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            files = repo.commits[commit]
            self._json(200, {"id": repo_id, "_id": repo_id, "modelId": repo_id, "sha": commit,
                             "private": repo.private, "siblings": [{"rfilename": p} for p in sorted(files)],
                             "tags": [], "downloads": 0, "likes": 0})

        def _tree(self, repo_id: str, rev: str, prefix: str, query: dict[str, list[str]]) -> None:
            found = self._readable(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            out: list[dict[str, object]] = []
            dirs: set[str] = set()
            for path, f in sorted(repo.commits[commit].items()):
                if prefix and not path.startswith(prefix.rstrip("/") + "/"):
                    continue
                rest = path[len(prefix.rstrip("/")) + 1:] if prefix else path
                parts = rest.split("/")
                base = (prefix.rstrip("/") + "/") if prefix else ""
                for i in range(1, len(parts)):
                    d = base + "/".join(parts[:i])
                    if d not in dirs and (recursive or i == 1):
                        dirs.add(d)
                        out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                    "path": d})
                if not recursive and len(parts) > 1:
                    continue
                entry: dict[str, object] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": path}
                if f.lfs_oid:
                    entry["lfs"] = {"oid": f.lfs_oid, "size": f.size, "pointerSize": 134}
                out.append(entry)
            self._json(200, out)

        def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
            found = self._readable(repo_id, rev)
            if found is None:
                return
            repo, commit = found
            f = repo.commits[commit].get(path)
            if f is None:
                return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"},
                                  head=head)
            common = {"X-Repo-Commit": commit}
            if f.lfs_oid:
                # same host, so the client follows the redirect: the object URL repeats the hub headers
                location = f"{hub.url}/lfs-objects/{quote(f.lfs_oid)}?commit={commit}"
                return self._send(302, b"", {**common, "Location": location, "ETag": f'"{f.blob_id}"',
                                              "X-Linked-Etag": f'"{f.lfs_oid}"', "X-Linked-Size": str(f.size)},
                                  head=head)
            assert f.content is not None
            self._send(200, f.content, {**common, "ETag": f'"{f.blob_id}"'}, "application/octet-stream", head)

        def _serve_object(self, oid: str, commit: str, head: bool) -> None:
            path = hub.object_path(oid)
            if not path.exists():
                return self._error(404, "no such object")
            data = path.read_bytes()
            linked = {"X-Repo-Commit": commit, "X-Linked-Etag": f'"{oid}"', "X-Linked-Size": str(len(data))}
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                start_s, _, end_s = rng[6:].partition("-")
                start = int(start_s)
                end = int(end_s) if end_s else len(data) - 1
                part = data[start:end + 1]
                return self._send(206, part, {**linked, "Content-Range": f"bytes {start}-{end}/{len(data)}",
                                              "ETag": f'"{oid}"'}, "application/octet-stream", head)
            self._send(200, data, {**linked, "ETag": f'"{oid}"', "Accept-Ranges": "bytes"}, "application/octet-stream",
                       head)

    return Handler
