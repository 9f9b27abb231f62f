"""RTN conversion in one process vs 2 torchrun ranks (gloo, 1 worker thread each) on the GLM-5-shaped FP8 source.

The source is the one `bench/convert_vs_model_free_ptq.py` generates (same config). Each configuration runs
in fresh processes, alternating, `--repeat` times: one process through plain `python`, then 2 ranks through
`python -m torch.distributed.run --nproc-per-node 2`. Every rank records its own CPU seconds, its peak RSS
(VmHWM; ru_maxrss would carry the launcher's over exec) and its in-process conversion time; the bench
samples the RSS of the whole process tree (torchrun's agent included) every 20 ms. The outputs must be
byte-identical (every file).

    python bench/distributed_convert.py --shards 8 --repeat 2 --out bench/results
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from convert_vs_model_free_ptq import BENCH_CONFIG, tree_rss_bytes  # noqa: E402

RANK = r"""
import json, os, resource, sys, time
start = time.perf_counter()
from quantkit.convert import convert
from quantkit.recipe import load_recipe
imported = time.perf_counter() - start
result = convert(sys.argv[1], sys.argv[2], load_recipe("glm5-w4a16-g32", {}), workers=1)
usage = resource.getrusage(resource.RUSAGE_SELF)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))  # this process's own peak
rank = int(os.environ.get("RANK", "0"))
record = {"rank": rank, "import_s": imported, "convert_s": result.seconds, "cpu_s": usage.ru_utime + usage.ru_stime,
          "peak_rss_bytes": int(hwm.split()[1]) * 1024}
with open(os.path.join(sys.argv[3], f"rank{rank}.json"), "w") as fh:
    json.dump(record, fh)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(ranks: int, src: Path, out: Path, records: Path) -> dict[str, object]:
    """One conversion in fresh processes; wall, CPU of the whole tree, tree peak RSS, each rank's record."""
    shutil.rmtree(records, ignore_errors=True)
    records.mkdir(parents=True)
    script = records / "rank.py"
    script.write_text(RANK)
    launcher = ([sys.executable] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                 "127.0.0.1", "--master-port", str(_free_port())])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cpu0, start = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen([*launcher, str(script), str(src), str(out), str(records)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{ranks}-rank run failed:\n{err[-3000:]}")
    per_rank = sorted((json.loads(p.read_text()) for p in records.glob("rank*.json")), key=lambda r: r["rank"])
    return {"ranks": ranks, "wall_s": time.perf_counter() - start, "cpu_s": _children_cpu() - cpu0,
            "tree_peak_rss_bytes": peak[0], "per_rank": per_rank}


def digest_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def shares(src: Path, ranks: int) -> list[int]:
    """Source bytes each rank converts (the partition `convert` computes: World.balanced over the shards)."""
    from quantkit.checkpoint.source import open_source
    from quantkit.convert.plan import plan_conversion
    from quantkit.distributed import World
    from quantkit.recipe import load_recipe

    source = open_source(src)
    plans = plan_conversion(source, load_recipe("glm5-w4a16-g32", {}))
    sizes = [sum(p.source.nbytes for p in plans[s]) for s in source.shard_files]
    return [sum(sizes[i] for i in World(r, ranks).balanced(sizes)) for r in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--src", type=Path, default=None, help="reuse a source generated by an earlier run")
    args = parser.parse_args()

    from quantkit.synth import make_checkpoint

    work = args.out / "distributed_convert"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = args.src or make_checkpoint(work / "src", "glm_moe_dsa", "fp8", size="tiny", shards=args.shards,
                                      config_overrides={**BENCH_CONFIG, "num_hidden_layers": args.layers})
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    split = shares(src, 2)
    print(f"source {source_bytes / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards; 2-rank split of "
          f"the converted bytes: {[round(b / 1e9, 3) for b in split]} GB")

    load_before = os.getloadavg()[0]
    runs: list[dict[str, object]] = []
    reference: dict[str, str] | None = None
    for k in range(args.repeat):
        for ranks in (1, 2):
            out = work / f"out-{ranks}"
            shutil.rmtree(out, ignore_errors=True)
            r = run(ranks, src, out, work / f"records-{ranks}")
            r["repeat"] = k
            digest = digest_tree(out)
            reference = reference or digest
            r["identical_to_first"] = digest == reference
            runs.append(r)
            shutil.rmtree(out, ignore_errors=True)
    load_after = os.getloadavg()[0]

    def median(ranks: int, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs if r["ranks"] == ranks)  # type: ignore[arg-type]

    result = {"source_bytes": source_bytes, "rank_shares_bytes": split, "cpus": os.cpu_count(),
              "load_average_before_after": [round(load_before, 2), round(load_after, 2)],
              "speedup_wall_median": round(median(1, "wall_s") / median(2, "wall_s"), 3),
              "all_outputs_identical": all(r["identical_to_first"] for r in runs), "runs": runs}
    (args.out / "distributed_convert.json").write_text(json.dumps(result, indent=2))

    print("| run | ranks | wall s | CPU s (tree) | peak RSS (tree) | per rank: convert s / CPU s / peak RSS / "
          "import s |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in runs:
        ranks_txt = "; ".join(f"r{p['rank']}: {p['convert_s']:.1f} / {p['cpu_s']:.1f} / "
                              f"{p['peak_rss_bytes'] / 1e9:.2f} GB / {p['import_s']:.1f}"
                              for p in r["per_rank"])  # type: ignore[union-attr]
        print(f"| {r['repeat']} | {r['ranks']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
              f"{r['tree_peak_rss_bytes'] / 1e9:.2f} GB | {ranks_txt} |")  # type: ignore[operator]
    print(f"\nmedian wall speed-up 1 -> 2 ranks: {result['speedup_wall_median']}x; outputs byte-identical: "
          f"{result['all_outputs_identical']}; load average {load_before:.1f} -> {load_after:.1f} on "
          f"{os.cpu_count()} CPUs")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
