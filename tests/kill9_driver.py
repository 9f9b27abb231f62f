"""kill -9 at every filesystem mutation of `convert`, then rerun and compare bytes (run as a script).

    python tests/kill9_driver.py SRC WORK [--every N] [--workers W] [--override key=value ...]

A clean conversion runs first in a forked child that counts, through a Python audit hook, every
mutation under its output's folder (open for writing, rename/replace, unlink, mkdir, rmdir, rmtree,
copyfile, each unlink inside an rmtree). Between two mutations nothing on disk changes, so killing
at each of them covers every state a kill can leave. Then, for every chosen mutation k, a fresh
child SIGKILLs itself right before mutation k; what it left is checked (OUT absent, or complete);
a rerun in another child must finish, and the output must hash exactly like the clean one.
Prints one JSON line: {"events": N, "killed_at": [...], "failures": [...]}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)  # forked children must not inherit a started OpenMP pool

from quantkit.checkpoint.qconfig import build_quantization_config  # noqa: E402
from quantkit.convert.pipeline import convert  # noqa: E402
from quantkit.core.errors import QuantkitError  # noqa: E402
from quantkit.quant.recipe import load_recipe  # noqa: E402

_MUTATIONS = {"os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "shutil.copyfile", "os.truncate",
              "os.link", "os.symlink"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
EXIT_DONE, EXIT_ALREADY, EXIT_ERROR = 0, 3, 4


def digest_tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def _is_mutation(event: str, args: tuple[object, ...], under: str) -> bool:
    if event == "open":
        path, mode, flags = args
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(int(flags or 0) & _WRITE_FLAGS)
        return writes and isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(under)
    if event not in _MUTATIONS or not args:
        return False
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.fsdecode(path)
    inside_rmtree = len(args) > 1 and isinstance(args[-1], int) and not os.path.isabs(path)  # dir_fd-relative
    return path.startswith(under) or inside_rmtree


def _child(src: Path, out: Path, recipe_overrides: dict[str, str], workers: int, kill_at: int | None,
           count_file: Path | None) -> None:
    """Runs in a forked child; never returns."""
    under, seen = str(out.parent), [0]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if _is_mutation(event, args, under):
            seen[0] += 1
            if kill_at is not None and seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    code = EXIT_DONE
    try:
        convert(src, out, load_recipe(None, json.loads((src / "config.json").read_text()), recipe_overrides),
                workers=workers)
    except QuantkitError as exc:
        code = EXIT_ALREADY if "already converted" in str(exc) else EXIT_ERROR
        print(f"child error: {exc}", file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - reported through the exit status
        print(f"child crash: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    if count_file is not None:
        count_file.write_text(str(seen[0]))
    os._exit(code)


def _fork(*args: object) -> tuple[bool, int]:
    """(killed by SIGKILL, exit status) of a child running `_child(*args)`."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(*args)  # type: ignore[arg-type]
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status) == signal.SIGKILL, -os.WTERMSIG(status)
    return False, os.WEXITSTATUS(status)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--every", type=int, default=1, help="kill at every N-th mutation (and always the last 12)")
    ap.add_argument("--at", type=int, nargs="*", help="kill at these mutations only")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--override", nargs="*", default=[])
    a = ap.parse_args()
    overrides = dict(kv.split("=", 1) for kv in a.override)
    build_quantization_config(32, [])  # import compressed-tensors once, before forking, not in every child
    clean = a.work / "clean"
    clean.mkdir(parents=True)
    killed, status = _fork(a.src, clean / "out", overrides, a.workers, None, clean / "count")
    if killed or status != EXIT_DONE:
        print(json.dumps({"events": 0, "killed_at": [], "failures": [f"clean run failed: status {status}"]}))
        return
    events = int((clean / "count").read_text())
    reference = digest_tree(clean / "out")
    chosen = a.at or sorted(set(range(1, events + 1, a.every)) | set(range(max(1, events - 11), events + 1)))
    failures, states = [], {}
    for k in chosen:
        run = a.work / f"k{k:04d}"
        run.mkdir()
        out = run / "out"
        killed, status = _fork(a.src, out, overrides, a.workers, k, None)
        if not killed:
            failures.append(f"kill at mutation {k}: the child was not killed (status {status})")
            continue
        left = sorted(p.name for p in run.iterdir())
        states[k] = left
        # a kill right after the publishing rename may leave the run's lock file in OUT; the next run removes it
        if out.exists() and digest_tree(out, skip=(".quantkit.lock",)) != reference:
            failures.append(f"kill at mutation {k}: OUT exists but differs from a clean run")
        _, status = _fork(a.src, out, overrides, a.workers, None, None)
        expected = (EXIT_ALREADY, EXIT_DONE) if out.exists() else (EXIT_DONE,)
        if status not in expected:
            failures.append(f"kill at mutation {k} (left {left}): rerun exited {status}")
            continue
        if not out.exists() or digest_tree(out) != reference:
            failures.append(f"kill at mutation {k} (left {left}): rerun output differs from a clean run")
        leftovers = sorted(p.name for p in run.iterdir() if p.name != "out")
        if leftovers:
            failures.append(f"kill at mutation {k}: rerun left {leftovers} next to OUT")
    print(json.dumps({"events": events, "killed_at": chosen, "failures": failures,
                      "states": sorted({" ".join(v) for v in states.values()})}))


if __name__ == "__main__":
    main()
