"""One rank of a distributed calibration run (started N times by tests/test_calib_distributed.py or torchrun).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python tests/dist_calib_driver.py SRC WORK \
        [--tokens FILE] [--samples S] [--seq-len L] [--batch B] [--roles routed_expert,attention] [--kv] \
        [--budget BYTES] \
        [--kill-after K --kill-rank R] [--fail-after K --fail-rank R]

Calls `quantkit.calibrate.runner.run` the way `quantkit convert` does under torchrun: the world from the
environment, every rank with the same arguments and a shared work directory, failures through
`World.guard`. `--kill-after K` makes rank R SIGKILL itself once layer K is published; `--fail-after K`
makes it raise a QuantkitError there instead. Prints one JSON line: rank, world size, peak RSS, CPU
seconds and wall time (whole process and inside `run`), the modules of the loaded result and its
per-phase times; a QuantkitError prints its message to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from quantkit.calibrate.runner import RunOptions, run  # noqa: E402
from quantkit.checkpoint.source import open_source  # noqa: E402
from quantkit.core.distributed import World  # noqa: E402
from quantkit.core.errors import QuantkitError  # noqa: E402
from quantkit.quant.recipe import Recipe  # noqa: E402


def tokens(src: Path, samples: int, seq_len: int, path: Path | None) -> torch.Tensor:
    """The calibration windows: from `path` (a safetensors file with `tokens`), else from the corpus."""
    if path is not None:
        from safetensors.torch import load_file

        return load_file(path)["tokens"]
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.tiny import CORPUS

    return calibration_tokens(CORPUS, AutoTokenizer.from_pretrained(str(src)), samples, seq_len, 0)


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _rss_mib(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or its peak (VmHWM). Not getrusage's ru_maxrss: on Linux
    that starts at the parent's RSS at fork time, so a child of a big launcher would report the launcher."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--tokens", type=Path, help="pre-tokenized windows (safetensors, key `tokens`)")
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--roles", default="routed_expert")
    ap.add_argument("--kv", action="store_true", help="also FP8 KV statistics")
    ap.add_argument("--budget", type=int, default=2 << 30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--fail-after", type=int)
    ap.add_argument("--fail-rank", type=int, default=1)
    a = ap.parse_args()
    world = World.from_env("cpu")
    t0 = time.time()
    phases: dict[str, float] = {}

    def progress(msg: str) -> None:
        if msg.startswith("calibration: layer ") and "(" in msg:
            for part in msg[msg.index("(") + 1 : -1].split(", "):
                name, secs = part.split()
                phases[name] = phases.get(name, 0.0) + float(secs[:-1])
        for k, what in ((a.kill_after, "kill"), (a.fail_after, "fail")):
            rank = a.kill_rank if what == "kill" else a.fail_rank
            if k is not None and world.rank == rank and msg.startswith(f"calibration: layer {k + 1}/"):
                if what == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise QuantkitError(f"injected failure on rank {rank} after layer {k}")

    try:
        world.start()
        with world.guard(lambda: a.work / "dist"):
            source = open_source(a.src)
            roles = [r for r in a.roles.split(",") if r]
            recipe = Recipe(method="gptq", kv_cache="fp8" if a.kv else None, quantize_roles=roles,
                            calibration={"samples": a.samples, "seq_len": a.seq_len})
            opts = RunOptions(tokens=tokens(a.src, a.samples, a.seq_len, a.tokens), batch_size=a.batch,
                              threads=a.threads, memory_budget=a.budget)
            rss0, cpu0, t1 = _rss_mib(), _cpu_s(), time.time()
            result = run(source, recipe, a.work, progress, opts, world)
            calib = {"calib_cpu_s": _cpu_s() - cpu0, "calib_wall_s": time.time() - t1, "rss_before_run_mib": rss0}
        world.stop()
    except QuantkitError as exc:
        print(f"rank {world.rank}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({
        "rank": world.rank, "world_size": world.size, "wall_s": time.time() - t0,
        "peak_rss_mib": _rss_mib("VmHWM"),
        "cpu_s": _cpu_s(), **calib,
        "modules": len(result.modules_quantized()), "phases": phases,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
