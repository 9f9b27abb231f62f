"""Push to and pull from a Hugging Face hub with huggingface_hub's own client.

Endpoint and token are resolved exactly as huggingface_hub's CLI resolves them (`HF_ENDPOINT`,
`HF_TOKEN`, then the token `hf auth login` stored); quantkit never reads, prints or stores the token
itself, and scrubs it from any error text it passes on.

push:  SHA256SUMS re-verified and `validate` passed before any byte is sent -> card regenerated with
       the repo id -> `create_repo(exist_ok=True)` -> `upload_folder` -> the remote file list, sizes and
       sha256 (LFS oid, or git blob id for small files) checked against the manifest.
       `upload_folder`, not `upload_large_folder`: the latter is deprecated in huggingface_hub 1.x and
       resumes from local metadata in `OUT/.cache/huggingface/upload`, so it can report success for a
       second repo while uploading nothing. `upload_folder` asks the server what it already has
       (LFS batch: objects present get no upload action; Xet: chunk dedup and already-committed files
       skipped), so an interrupted push resumes from what the server really holds.
pull:  the repo tree is listed first; only safetensors, JSON, tokenizer files, chat templates, `*.py`
       (copied, never executed), Markdown/YAML/LICENSE and SHA256SUMS are fetched, pickle files
       (`*.bin`, `*.pt`, `*.pth`, `*.pkl`, ...) never; `snapshot_download(local_dir=...)` resumes partial
       files; every file is then checked against the hub's size and sha256 and against SHA256SUMS.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantkit.checkpoint.manifest import MANIFEST_NAME, read_manifest, sha256_file, update_manifest, verify_manifest
from quantkit.checkpoint.source import PICKLE_SUFFIXES
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import make_parents, open_write, replace, safe_mkdir
from quantkit.core.progress import Reporter, Silent
from quantkit.hub import ORIGIN_FILE, read_origin
from quantkit.hub.card import CARD_NAME, is_generated_card, write_card

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

__all__ = ["PullResult", "PushResult", "hub_cache_dir", "is_hub_id", "pull", "push", "resolve_source"]

PULL_PATTERNS = ("*.safetensors", "*.json", "*.py", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.md",
                 "*.yaml", "*.yml", "LICENSE*", "LICENCE*", "NOTICE*", MANIFEST_NAME, "tokenizer*")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(@[\w./-]+)?")


def _endpoint() -> str:
    """The hub endpoint huggingface_hub's CLI would use (read at call time, not import time)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _api() -> HfApi:
    from huggingface_hub import HfApi

    return HfApi(endpoint=_endpoint())


def _require_token() -> None:
    from huggingface_hub import get_token

    if not get_token():
        raise QuantkitError(f"{_endpoint()}: no Hugging Face token (set HF_TOKEN or run `hf auth login`); "
                            "nothing was uploaded")


def _scrub(text: str) -> str:
    from huggingface_hub import get_token

    token = get_token()
    text = " ".join(text.split())  # one line
    return text.replace(token, "***") if token else text


@contextlib.contextmanager
def _hub_errors(what: str) -> Iterator[None]:
    """huggingface_hub / network errors -> one-line QuantkitError (exit 2), token scrubbed."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        yield
    except QuantkitError:
        raise
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = " (check the token's write access)" if status in (401, 403) else ""
        raise QuantkitError(_scrub(f"{what}: hub answered HTTP {status}{hint}: {str(exc).splitlines()[0]}")) from None
    except HFValidationError as exc:
        raise QuantkitError(_scrub(f"{what}: {exc}")) from None
    except (httpx.HTTPError, OSError) as exc:
        raise QuantkitError(_scrub(f"{what}: {type(exc).__name__}: {exc}")) from None


# ---- hashing --------------------------------------------------------------------------------------
def git_blob_sha1(path: Path) -> str:
    """The git blob id the hub reports for a regular (non-LFS) file."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _remote_mismatch(local: Path, remote: RepoFile, sha256: str | None) -> str | None:
    """Why `local` differs from the hub's record of it, or None when size and hash agree."""
    size = local.stat().st_size
    if remote.lfs is not None:
        if remote.lfs.size != size:
            return f"size {remote.lfs.size} on the hub, {size} here"
        got = sha256 or sha256_file(local)
        return None if got == remote.lfs.sha256 else "sha256 differs from the hub's LFS oid"
    if remote.size != size:
        return f"size {remote.size} on the hub, {size} here"
    return None if git_blob_sha1(local) == remote.blob_id else "git blob id differs from the hub's"


def _remote_files(api: HfApi, repo_id: str, revision: str) -> dict[str, RepoFile]:
    from huggingface_hub.hf_api import RepoFile

    return {f.path: f for f in api.list_repo_tree(repo_id, revision=revision, recursive=True)
            if isinstance(f, RepoFile)}


# ---- push -----------------------------------------------------------------------------------------
@dataclass
class PushResult:
    repo_id: str
    commit: str
    url: str
    files: int
    bytes: int
    pr_url: str | None = None
    extra_remote_files: list[str] = field(default_factory=list)


def push(
    out: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    base_model: str | None = None,
    keep_card: bool = False,
    workers: int = 4,
    progress: Reporter | None = None,
) -> PushResult:
    """Verify OUT, upload it to REPO_ID, and check the remote files against the manifest."""
    from quantkit.validate.checkpoint import validate_checkpoint

    progress = progress or Silent()
    if create_pr and revision:
        raise QuantkitError("--create-pr opens a pull request against the default branch; drop --revision")
    if not out.is_dir():
        raise QuantkitError(f"{out}: not a directory")
    _require_token()
    _verify_local(out, workers, progress, "nothing was uploaded")
    report = validate_checkpoint(out, None)
    if not report.ok:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in report.checks if c.status == "fail")
        raise QuantkitError(f"{out}: validate failed ({failed}); nothing was uploaded")
    if not keep_card and is_generated_card(out / CARD_NAME):
        write_card(out, repo_id, base_model)  # launch commands name the repo; manifest follows
        update_manifest(out, [CARD_NAME])
    files = [*read_manifest(out), MANIFEST_NAME]
    total = sum((out / f).stat().st_size for f in files)
    api = _api()
    progress.note(f"pushing {len(files)} files ({total / 1e9:.2f} GB) to {_endpoint()}/{repo_id}")
    with _hub_errors(f"{_endpoint()}/{repo_id}"):
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=out, revision=revision, create_pr=create_pr,
            commit_message=commit_message or f"Upload INT4 W4A16 checkpoint ({len(files)} files) with quantkit",
            allow_patterns=[_literal_pattern(f) for f in files],
            delete_patterns=["*.safetensors"],  # stale shards of an earlier push, never the ones just added
        )
        remote = _remote_files(api, repo_id, info.oid)
    problems = []
    digests = read_manifest(out)
    for rel in files:
        if rel not in remote:
            problems.append(f"{rel}: missing on the hub")
            continue
        why = _remote_mismatch(out / rel, remote[rel], digests.get(rel))
        if why:
            problems.append(f"{rel}: {why}")
    if problems:
        raise QuantkitError(f"{repo_id}@{info.oid}: remote check failed: {problems[0]} ({len(problems)} problem(s))")
    extra = sorted(set(remote) - set(files) - {".gitattributes"})
    return PushResult(repo_id, info.oid, str(info.commit_url), len(files), total, info.pr_url, extra)


def _literal_pattern(rel: str) -> str:
    """An fnmatch pattern matching exactly `rel`."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in rel)


def _verify_local(directory: Path, workers: int, progress: Reporter, consequence: str) -> None:
    check = verify_manifest(directory, workers, on_total=lambda n: progress.stage("verifying sha256", n),
                            on_bytes=progress.advance)
    if not check.ok:
        problems = check.problems()
        raise QuantkitError(f"{directory / problems[0]} ({len(problems)} problem(s) against {MANIFEST_NAME}); "
                            f"{consequence}")


# ---- pull -----------------------------------------------------------------------------------------
@dataclass
class PullResult:
    repo_id: str
    commit: str
    directory: Path
    files: list[str]
    refused: list[str]
    skipped: list[str]
    bytes: int


def _wanted(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(name, p) for p in PULL_PATTERNS)


def pull(
    repo_id: str,
    dest: Path,
    revision: str | None = None,
    *,
    workers: int = 4,
    progress: Reporter | None = None,
) -> PullResult:
    """Download REPO_ID into DEST (resumable), never a pickle file; verify every file."""
    from huggingface_hub import snapshot_download

    progress = progress or Silent()
    api = _api()
    where = f"{_endpoint()}/{repo_id}"
    with _hub_errors(where):
        commit = api.repo_info(repo_id, revision=revision, repo_type="model").sha
        remote = _remote_files(api, repo_id, commit)
    refused = sorted(p for p in remote if p.lower().endswith(PICKLE_SUFFIXES))
    files = sorted(p for p in remote if p not in refused and _wanted(p) and not p.startswith("."))
    skipped = sorted(set(remote) - set(files) - set(refused))
    if not any(f.endswith(".safetensors") for f in files):
        what = f"only pickle weights ({', '.join(refused[:3])})" if refused else "no *.safetensors files"
        raise QuantkitError(f"{where}@{commit}: holds {what}; pickle files are never downloaded")
    for p in refused:
        progress.note(f"refused {p}: pickle file, never downloaded")
    make_parents(dest)  # missing parents created one by one under the path rule (quantkit.core.paths)
    safe_mkdir(dest)  # a link planted at DEST is refused: nothing is downloaded through it
    origin = {"repo_id": repo_id, "revision": revision or "main", "commit": commit, "verified": False}
    _write_origin(dest, origin)
    with _hub_errors(where):
        snapshot_download(repo_id, revision=commit, local_dir=dest, allow_patterns=[_literal_pattern(f) for f in files],
                          endpoint=_endpoint(), max_workers=workers)
    progress.stage("verifying sha256", sum(remote[f].size for f in files))
    _check_pulled(dest, files, remote, workers, where, progress)
    _write_origin(dest, {**origin, "verified": True})
    return PullResult(repo_id, commit, dest, files, refused, skipped, sum((dest / f).stat().st_size for f in files))


def _write_origin(dest: Path, origin: dict[str, str | bool]) -> None:
    tmp = dest / (ORIGIN_FILE + ".tmp")
    with open_write(tmp, text=True) as fh:
        fh.write(json.dumps(origin, indent=2) + "\n")
    replace(tmp, dest / ORIGIN_FILE)


def _check_pulled(dest: Path, files: list[str], remote: dict[str, RepoFile], workers: int, where: str,
                  progress: Reporter) -> None:
    """Each file against the hub's size and sha256 (one read), and against SHA256SUMS when present."""
    def digest(rel: str) -> str | None:
        if remote[rel].lfs is None:  # small file: checked by git blob id below
            progress.advance(remote[rel].size)
            return None
        return sha256_file(dest / rel, progress.advance)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        digests = dict(zip(files, pool.map(digest, files), strict=True))
    manifest = read_manifest(dest) if (dest / MANIFEST_NAME).exists() else {}
    for rel in files:
        why = _remote_mismatch(dest / rel, remote[rel], digests[rel])
        if why is None and rel in manifest:
            why = None if (digests[rel] or sha256_file(dest / rel)) == manifest[rel] else "differs from SHA256SUMS"
        if why:
            (dest / rel).unlink()  # a rerun downloads it again
            raise QuantkitError(f"{dest / rel}: {why} ({where}); removed, rerun to download it again")
    missing = sorted(set(manifest) - set(files))
    if missing:
        raise QuantkitError(f"{dest / missing[0]}: listed in {MANIFEST_NAME} but not on the hub ({where})")


# ---- hub ids as sources ---------------------------------------------------------------------------
def is_hub_id(spec: str) -> bool:
    """`owner/name[@revision]` that is not an existing local path."""
    return not Path(spec).exists() and _REPO_ID.fullmatch(spec) is not None


def hub_cache_dir() -> Path:
    """Where hub sources are pulled: $QUANTKIT_HUB_CACHE, else $HF_HOME/quantkit (plain files, no symlinks)."""
    if os.environ.get("QUANTKIT_HUB_CACHE"):
        return Path(os.environ["QUANTKIT_HUB_CACHE"])
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(hf_home) / "quantkit"


def resolve_source(spec: str | os.PathLike[str], config_only: bool = False, progress: Reporter | None = None) -> Path:
    """A local directory for SPEC: itself when it exists, else the pulled hub repo `owner/name[@rev]`.

    `config_only` fetches just config.json (what `quantkit plan` needs).
    """
    text = os.fspath(spec)
    if not is_hub_id(text):
        return Path(text)
    try:
        return _pull_source(text, config_only, progress)
    except QuantkitError as exc:
        raise QuantkitError(f"{text}: no such local directory, and as a hub repo id: {exc}") from None


def _pull_source(text: str, config_only: bool, progress: Reporter | None) -> Path:
    repo_id, _, revision = text.partition("@")
    dest = hub_cache_dir() / (repo_id.replace("/", "--") + (f"@{revision}" if revision else ""))
    if config_only:
        from huggingface_hub import hf_hub_download

        with _hub_errors(f"{_endpoint()}/{repo_id}"):
            hf_hub_download(repo_id, "config.json", revision=revision or None, local_dir=dest, endpoint=_endpoint())
        return dest
    origin = read_origin(dest)
    if origin and origin.get("verified"):
        with _hub_errors(f"{_endpoint()}/{repo_id}"):
            commit = _api().repo_info(repo_id, revision=revision or None).sha
        if commit == origin.get("commit"):
            return dest  # already pulled and verified at this commit
    (progress or Silent()).note(f"pulling {repo_id} into {dest}")
    pull(repo_id, dest, revision or None, progress=progress)
    return dest
