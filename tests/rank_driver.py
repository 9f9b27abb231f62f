"""One torchrun rank of `quantkit`, with faults a test can aim at one rank (run by torchrun as a script).

    torchrun --nproc-per-node N tests/rank_driver.py [--kill-rank R --before-journal K]
             [--private-rank R --private-dir DIR] [--rank-args R "ARG ..."] -- convert SRC OUT ...

--kill-rank R --before-journal K   rank R SIGKILLs itself right before writing its K-th shard journal entry
                                   (a real kill -9 at a chosen instant, found with a Python audit hook)
--private-rank R --private-dir DIR rank R sees its own empty tmpfs at DIR, as a rank on another node without a
                                   shared file system would (a Linux mount namespace; needs root)
--rank-args R "ARG ..."            rank R appends these arguments to the command line (a node that would run
                                   another recipe)

Everything after `--` is the quantkit command line, run through the real entry point `quantkit.cli.main`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _kill_before_journal(count: int) -> None:
    seen = [0]

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event != "open" or not isinstance(args[0], str | os.PathLike):
            return
        path, mode, flags = os.fspath(args[0]), args[1], args[2]
        name = os.path.basename(path)
        writes = "w" in mode if isinstance(mode, str) else bool(int(flags or 0) & (os.O_WRONLY | os.O_RDWR))
        if writes and name.startswith("shard-") and name.endswith(".json.tmp"):  # os.open: mode None, flags set
            seen[0] += 1
            if seen[0] == count:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill-rank", type=int)
    ap.add_argument("--before-journal", type=int, default=1)
    ap.add_argument("--private-rank", type=int, default=1)
    ap.add_argument("--private-dir")
    ap.add_argument("--rank-args", nargs=2)
    opts = ap.parse_args(argv[:split])
    rank = int(os.environ.get("RANK", "0"))
    if opts.private_dir and rank == opts.private_rank and not os.environ.get("_RANK_DRIVER_PRIVATE"):
        os.environ["_RANK_DRIVER_PRIVATE"] = "1"  # once, in the re-executed process: mount, then run as usual
        script = 'mount -t tmpfs tmpfs "$0" && exec "$@"'
        os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, opts.private_dir,
                              sys.executable, *sys.argv])
    if opts.kill_rank == rank:
        _kill_before_journal(opts.before_journal)
    extra = opts.rank_args[1].split() if opts.rank_args and int(opts.rank_args[0]) == rank else []
    sys.argv = ["quantkit", *argv[split + 1:], *extra]
    from quantkit.cli import main as quantkit_main

    quantkit_main()


if __name__ == "__main__":
    main()
