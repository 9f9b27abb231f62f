"""quantkit convert vs llm-compressor model_free_ptq on a generated GLM-5-shaped FP8-block checkpoint.

Same source, same scheme (W4A16 symmetric group 32 on the routed experts), same FP8 dequantizer role,
same number of worker processes and threads; each tool runs in a fresh process while a sampler sums the
resident memory of its whole process tree every 20 ms. Prints a Markdown table of source GB/s, CPU
seconds (user + system of the tool's whole process tree) and peak RSS, both absolute and as
quantkit/peer ratios, and checks the two outputs are bit-identical.

The source is generated in a child process: the generator leaves a ~4 GB heap behind, and with it
held by this process the timed tool's system time rose by up to ~4 CPU-s (docs/benchmarks.md, RTN run 6).
quantkit's fused kernels are numba functions cached on disk (`quantkit/quant/__pycache__`): the first
run after a fresh checkout, or after `quantkit/quant/fused.py` changed, compiles them (~3-5 CPU-s).
Before the timed run, quantkit converts a tiny generated checkpoint once, which fills that cache; its CPU
seconds are printed apart (`--no-warm-up` times the first run as it comes).

    python bench/convert_vs_model_free_ptq.py --workers 2 --shards 4
    python bench/convert_vs_model_free_ptq.py --workers 2 --shards 4 --scheme nvfp4a16

`--scheme nvfp4a16 | mxfp4a16` runs the FP4 schemes (the peer with compressed-tensors' NVFP4A16 / MXFP4A16
preset on the same targets). The peer gives each expert's gate_proj and up_proj their own NVFP4 global
scale where quantkit fuses them (docs/fp4.md), so those tensors differ by design: the comparison reports the
unfused tensors (down_proj, every MXFP4 tensor) as bit-identical or not, and the gate/up ones apart.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# GLM-5 tensor names and layout, shapes scaled so that the routed experts are whole 128x128 FP8 blocks
# (the peer's dequantizer cannot save partial-block tensors, see docs/benchmarks.md).
BENCH_CONFIG = dict(hidden_size=2048, moe_intermediate_size=1024, intermediate_size=4096, n_routed_experts=48,
                    num_hidden_layers=6, num_attention_heads=16, vocab_size=16384, q_lora_rank=1024,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    index_n_heads=4, index_head_dim=128)

PEER = r"""
import json, sys, torch
torch.set_num_threads(int(sys.argv[4]))
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor import model_free_ptq
src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
index = json.load(open(src + "/model.safetensors.index.json"))["weight_map"]
fp8 = [n[: -len(".weight_scale_inv")] for n in index if n.endswith(".weight_scale_inv")]
experts = [m for m in fp8 if ".mlp.experts." in m]
targets = [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"]
if sys.argv[5] == "w4a16":
    scheme = QuantizationScheme(targets=targets, weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=32))
else:
    from compressed_tensors.quantization import preset_name_to_scheme
    scheme = preset_name_to_scheme(sys.argv[5].upper(), targets)
conv = FP8BlockDequantizer(targets=experts, ignore=[m for m in fp8 if m not in experts], weight_block_size=(128, 128))
model_free_ptq(src, out, scheme=scheme, ignore=[], max_workers=workers, converter=conv)
"""

GEN = r"""
import json, sys
from quantkit.checkpoint.synth import make_checkpoint
make_checkpoint(sys.argv[1], "glm_moe_dsa", "fp8", size="tiny", shards=int(sys.argv[2]),
                config_overrides=json.loads(sys.argv[3]))
"""

OURS = r"""
import sys, torch
torch.set_num_threads(int(sys.argv[4]))
from quantkit.convert.pipeline import convert
from quantkit.quant.recipe import load_recipe
convert(sys.argv[1], sys.argv[2], load_recipe("glm5-w4a16-g32", {}, {"scheme": sys.argv[5]}), workers=int(sys.argv[3]))
"""


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of `root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    total, stack = 0, [root]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        stack.extend(children.get(pid, []))
    return total


def _children_cpu() -> tuple[float, float]:
    """User and system CPU seconds of every reaped descendant so far: the tool and its workers."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def plain_read(src: Path) -> float:
    """Seconds to read every shard's bytes once (page cache warm: the tools read the same files)."""
    buf = bytearray(16 << 20)
    start = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - start


def run_sampled(cmd: list[str], env: dict[str, str], what: str) -> dict[str, float]:
    """Run `cmd` to the end, sampling its process tree's RSS every 20 ms: wall and CPU seconds (the whole
    tree: user + system, and each), peak tree RSS. A failed run stops the benchmark with its stderr."""
    user0, sys0 = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
        raise SystemExit(f"{what} failed:\n{err[-3000:]}")
    seconds = time.perf_counter() - start
    user, system = _children_cpu()
    return {"seconds": seconds, "cpu_seconds": user - user0 + system - sys0, "user_seconds": user - user0,
            "sys_seconds": system - sys0, "peak_rss_bytes": peak[0]}


def run_measured(code: str, args: list[str], threads: int, scheme: str = "w4a16") -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    return run_sampled([sys.executable, "-c", code, *args, str(threads), scheme], env, "benchmark run")


def generate_source(dest: Path, shards: int, config_overrides: dict[str, int]) -> Path:
    """Write a generated GLM-5-shaped FP8 checkpoint at `dest` from a child process, so that the generator's
    heap does not stay resident in the benchmark's process while the tools are timed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", GEN, str(dest), str(shards), json.dumps(config_overrides)], env=env,
                   check=True)
    return dest


def warm_up_kernels(work: Path, threads: int, scheme: str = "w4a16") -> float:
    """Convert a tiny generated checkpoint with quantkit once (the same kernels as the timed run, so their
    numba cache is filled); its CPU seconds, the interpreter start included."""
    src = generate_source(work / "warm_src", 1, {})
    return run_measured(OURS, [str(src), str(work / "warm_out"), "1"], threads, scheme)["cpu_seconds"]


_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale")
_FUSED_BY_QUANTKIT = (".gate_proj.", ".up_proj.")


def compare_outputs(a: Path, b: Path, fused_apart: bool = False) -> tuple[int, int]:
    """(packed/scale tensors that differ, tensors compared); with `fused_apart` (NVFP4) the gate/up tensors,
    whose global scales quantkit fuses and the peer does not, are left out of the comparison."""
    import torch
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, tuple[Path, str]]:
        out = {}
        for f in d.glob("*.safetensors"):
            with safe_open(f, "pt") as fh:
                out.update({k: (f, k) for k in fh.keys() if k.endswith(_SUFFIXES)
                            and not (fused_apart and any(p in k for p in _FUSED_BY_QUANTKIT))})
        return out

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and ta, "the two outputs quantized different modules"
    differ = 0
    for k in ta:
        with safe_open(ta[k][0], "pt") as fa, safe_open(tb[k][0], "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype == torch.float8_e4m3fn:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            differ += x.dtype != y.dtype or not torch.equal(x, y)
    return differ, len(ta)


def unfused_pairs(peer: Path) -> tuple[int, int]:
    """(experts whose gate/up global scales differ in the peer's output, experts)."""
    from safetensors import safe_open

    scales: dict[str, float] = {}
    for f in peer.glob("*.safetensors"):
        with safe_open(f, "pt") as fh:
            scales.update({k: float(fh.get_tensor(k)) for k in fh.keys() if k.endswith("proj.weight_global_scale")})
    gates = [k for k in scales if ".gate_proj." in k]
    return sum(scales[g] != scales[g.replace(".gate_proj.", ".up_proj.")] for g in gates), len(gates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (both tools)")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--ours-only", action="store_true", help="skip the peer (e.g. to show RSS vs shard size)")
    parser.add_argument("--src", type=Path, default=None, help="reuse a source generated by an earlier run")
    parser.add_argument("--scheme", default="w4a16", choices=["w4a16", "nvfp4a16", "mxfp4a16"])
    parser.add_argument("--no-warm-up", action="store_true",
                        help="time quantkit's first run as it comes (with a compile when the kernel cache is empty)")
    args = parser.parse_args()

    import shutil

    from quantkit.checkpoint.safetensors_header import read_header

    work = args.out / "convert"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t = time.perf_counter()
    src = args.src or generate_source(work / "src", args.shards, {**BENCH_CONFIG, "num_hidden_layers": args.layers})
    shards = [read_header(p).file_size for p in src.glob("*.safetensors")]
    source_bytes = sum(shards)
    print(f"generated {source_bytes / 1e9:.2f} GB in {len(shards)} shards (largest {max(shards) / 1e9:.2f} GB) "
          f"in {time.perf_counter() - t:.0f}s")

    warm_up_cpu = None if args.no_warm_up else warm_up_kernels(work, args.threads, args.scheme)
    if warm_up_cpu is not None:
        print(f"quantkit kernel warm-up (tiny checkpoint, not timed below): {warm_up_cpu:.2f} CPU-s")
    read_s = min(plain_read(src) for _ in range(3))
    load_before = os.getloadavg()[0]
    ours = run_measured(OURS, [str(src), str(work / "ours"), str(args.workers)], args.threads, args.scheme)
    if args.ours_only:
        print(f"quantkit convert: {ours['seconds']:.2f}s, {ours['cpu_seconds']:.2f} CPU-s (user "
              f"{ours['user_seconds']:.2f} + sys {ours['sys_seconds']:.2f}), "
              f"{source_bytes / ours['seconds'] / 1e9:.4f} GB/s, peak RSS {ours['peak_rss_bytes'] / 1e9:.3f} GB "
              f"(largest shard {max(shards) / 1e9:.2f} GB); "
              f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
        shutil.rmtree(work, ignore_errors=True)
        return
    peer = run_measured(PEER, [str(src), str(work / "peer"), str(args.workers)], args.threads, args.scheme)
    load_after = os.getloadavg()[0]
    differ, compared = compare_outputs(work / "peer", work / "ours", fused_apart=args.scheme == "nvfp4a16")
    unfused = unfused_pairs(work / "peer") if args.scheme == "nvfp4a16" else (0, 0)
    rows = {}
    for name, r in (("llm-compressor model_free_ptq", peer), ("quantkit convert", ours)):
        per_worker = r["peak_rss_bytes"] / args.workers / max(shards)
        rows[name] = {"seconds": round(r["seconds"], 2), "cpu_seconds": round(r["cpu_seconds"], 2),
                      "user_seconds": round(r["user_seconds"], 2), "sys_seconds": round(r["sys_seconds"], 2),
                      "source_GB_per_s": round(source_bytes / r["seconds"] / 1e9, 4),
                      "source_GB_per_cpu_s": round(source_bytes / r["cpu_seconds"] / 1e9, 4),
                      "peak_rss_GB": round(r["peak_rss_bytes"] / 1e9, 3),
                      "peak_rss_per_worker_over_largest_shard": round(per_worker, 3)}
    result = {"source_bytes": source_bytes, "shards": len(shards), "largest_shard_bytes": max(shards),
              "scheme": args.scheme, "workers": args.workers, "threads_per_worker": args.threads,
              "tensors_that_differ": differ, "tensors_compared": compared,
              "peer_experts_with_unfused_gate_up_scales": list(unfused),
              "plain_read_s": round(read_s, 3), "plain_read_GB_per_s": round(source_bytes / read_s / 1e9, 3),
              "load_average_before_after": [round(load_before, 2), round(load_after, 2)],
              "quantkit_warm_up_cpu_seconds": None if warm_up_cpu is None else round(warm_up_cpu, 2),
              "throughput_ratio": round(peer["seconds"] / ours["seconds"], 2),
              "cpu_ratio": round(peer["cpu_seconds"] / ours["cpu_seconds"], 2),
              "ours_over_plain_read": round(read_s / ours["seconds"], 4),
              "peak_rss_ratio": round(ours["peak_rss_bytes"] / peer["peak_rss_bytes"], 3), "runs": rows}
    suffix = "" if args.scheme == "w4a16" else f"_{args.scheme}"
    (args.out / f"convert_vs_model_free_ptq{suffix}.json").write_text(json.dumps(result, indent=2))
    print("| tool | wall s | CPU s | source GB/s | GB per CPU-s | peak RSS (tree) | RSS per worker / largest shard |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']} | {r['cpu_seconds']} | {r['source_GB_per_s']} | {r['source_GB_per_cpu_s']} | "
              f"{r['peak_rss_GB']} GB | {r['peak_rss_per_worker_over_largest_shard']} |")
    print(f"\nquantkit / peer throughput: {result['throughput_ratio']}x wall, {result['cpu_ratio']}x CPU; "
          f"peak RSS ratio {result['peak_rss_ratio']}; plain read {result['plain_read_GB_per_s']} GB/s (quantkit at "
          f"{result['ours_over_plain_read']:.1%} of it); load average {load_before:.1f} -> {load_after:.1f}; "
          f"packed/scale tensors that differ: {differ} of {compared}"
          + (f" (gate/up left out); peer experts with unfused gate/up global scales: {unfused[0]} of {unfused[1]}"
             if args.scheme == "nvfp4a16" else ""))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
