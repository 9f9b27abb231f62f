"""GPTQ calibration across ranks: 1 vs 2 gloo ranks on this machine, and a projection for GLM-5.2 on 8xH200.

    .venv/bin/python bench/distributed_gptq.py                 # ~2 min on 2 shared cores
    .venv/bin/python bench/distributed_gptq.py --samples 2 --seq-len 64 --layers 2   # quick smoke

Measured: a generated DeepSeek-V3-layout checkpoint (`quantkit.checkpoint.synth`, size "bench": hidden 1024, 32
experts of 512, 3 layers of which the first is dense) calibrated with GPTQ on every routed expert,
pre-tokenized random windows, batch 1: one process with 1 thread and 2 ranks x 1 thread
(`--two-threads`: also one process with 2 threads); each rank a fresh process started with torchrun's
environment (tests/dist_calib_driver.py). Per configuration:
wall (slowest rank, from process start), per-phase seconds summed over layers (per rank), peak RSS per
rank. FLOPs of each phase are counted from the shapes (`phase_flops`) to give the achieved rate.

Projected (NOT measured): GLM-5.2 (config from quantkit/plan/configs/glm-5.2) GPTQ on 8xH200 from the
same FLOP model and stated H200 throughput / kernel-launch assumptions, plus the expert-parallel traffic.
Results: bench/results/distributed_gptq.json and a printed table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DRIVER = REPO / "tests" / "dist_calib_driver.py"
PY = sys.executable

# ---- H200 assumptions for the projection (stated, not measured here) --------------------------------
H200_TFLOPS = {"bf16 tensor cores": 700.0, "tf32 tensor cores": 350.0, "fp32 (no tensor cores)": 55.0}
# sustained dense-GEMM rates assumed (peaks: 989 bf16, 494 tf32, 67 fp32 TFLOP/s)
NVLINK_GBS = 350.0  # sustained all-gather / all-reduce bus bandwidth per GPU, GB/s (NVLink 4: 450 per direction)
LAUNCH_US = 8.0  # one eager PyTorch CUDA op, launch-bound (small per-column ops of the GPTQ loop)
OPS_PER_COLUMN = 11  # tensor ops per column in gptq._gptq_loop (divide, round, clamp, cast, store, ...)
OPS_PER_BLOCK = 6  # per 128-column block (gather, slices, bmm update)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, src: Path, work: Path, tokens: Path, samples: int, seq: int, threads: int,
           roles: str = "routed_expert") -> list[dict]:
    """`n` ranks of the driver (n == 1: a plain single process), each one fresh process; their JSON lines."""
    port = _free_port()
    procs = []
    t0 = time.time()
    for r in range(n):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
        if n > 1:
            env.update({"RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        cmd = [PY, str(DRIVER), str(src), str(work), "--tokens", str(tokens), "--samples", str(samples),
               "--seq-len", str(seq), "--batch", "1", "--threads", str(threads), "--roles", roles]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"rank failed ({p.returncode}): {stderr[-2000:]}")
        rec = json.loads(stdout.strip().splitlines()[-1])
        rec["process_wall_s"] = time.time() - t0
        out.append(rec)
    return out


# ---- FLOP model -----------------------------------------------------------------------------------
def phase_flops(hidden: int, inter: int, experts: int, tokens: int, top_k: int, kept: bool,
                block: int = 128) -> dict[str, float]:
    """FLOPs of one MoE layer's calibration with GPTQ on the routed experts (all ranks together).

    Statistics mode "all": every expert's down Hessian needs every token through its gate/up
    (`4 T h i`) and `X^T X` (`2 T i^2`). With the MoE inputs kept (`kept`: the activations fit the memory
    budget) that happens in the gptq phase, pass 1 running only the routed tokens; streamed, it happens
    in pass 1. gptq also holds the GPTQ updates (rows x cols^2 per module plus the in-block updates)
    and the factorisations; pass 2 runs the routed tokens. Attention and shared experts are left out
    (about 5% more on GLM-5.2).
    """
    t, h, i, e = float(tokens), float(hidden), float(inter), float(experts)
    down_h = 4 * t * h * i + 2 * t * i * i  # one expert's down Hessian from all tokens
    routed = 6 * t * top_k * i * h  # gate, up and down of the routed tokens, all experts together
    solve = 2 * i * (h * h + h * block) + h * (i * i + i * block) + 2 * i**3
    stats = e * down_h
    pass1 = routed + 2 * t * h * h + (0.0 if kept else stats)
    gptq = e * solve + 2 * h**3 + (stats if kept else 0.0)
    return {"pass1": pass1, "gptq": gptq, "pass2": routed}


def column_steps(hidden: int, inter: int, experts_per_rank: int, rows_per_chunk: int) -> int:
    """Sequential GPTQ column iterations per rank and layer (one batched loop per chunk of experts)."""
    per_gu = max(1, rows_per_chunk // (2 * inter))
    per_down = max(1, rows_per_chunk // hidden)
    loops_gu = -(-experts_per_rank // per_gu)
    loops_down = -(-experts_per_rank // per_down)
    return loops_gu * hidden + loops_down * inter


def projection(rates: dict[str, float]) -> dict:
    """GLM-5.2 GPTQ on 8xH200 (a projection from the FLOP model and the assumptions above)."""
    cfg = json.loads((REPO / "quantkit/plan/configs/glm-5.2/config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    layers, dense, k = cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["num_experts_per_tok"]
    ranks, tokens = 8, 512 * 2048  # recipe defaults: 512 samples x 2048 tokens
    moe_layers = layers - dense
    f = phase_flops(h, i, e, tokens, k, kept=False)  # 25 GB of MoE inputs per layer: streamed
    per_rank_flops = sum(f.values()) / ranks
    # expert-parallel traffic per rank and MoE layer: all-gather of all tokens' inputs + all-reduce of
    # the outputs (ring: 2 (N-1)/N of the buffer), in both passes; fp32 activations
    buf = tokens * h * 4
    traffic = 2 * (buf * (ranks - 1) / ranks + 2 * buf * (ranks - 1) / ranks)
    comm_s = traffic / (NVLINK_GBS * 1e9)
    out: dict = {"model": "GLM-5.2", "hidden": h, "moe_intermediate": i, "experts": e, "layers": layers,
                 "moe_layers": moe_layers, "ranks": ranks, "calibration_tokens": tokens,
                 "flops_per_moe_layer": f, "traffic_per_rank_per_layer_gb": traffic / 1e9,
                 "assumptions": {"sustained_tflops": H200_TFLOPS, "nvlink_gbs": NVLINK_GBS,
                                 "launch_us": LAUNCH_US, "ops_per_column": OPS_PER_COLUMN},
                 "scenarios": []}
    for chunk_rows, label in ((4096, "GPTQ chunk 4096 rows (the CPU setting)"),
                              (65536, "GPTQ chunk 65536 rows (the CUDA setting)")):
        steps = column_steps(h, i, e // ranks, chunk_rows)
        loop_s = steps * OPS_PER_COLUMN * LAUNCH_US * 1e-6 + steps / 128 * OPS_PER_BLOCK * LAUNCH_US * 1e-6
        for precision, tflops in H200_TFLOPS.items():
            compute_s = per_rank_flops / (tflops * 1e12)
            layer_s = compute_s + comm_s + loop_s
            out["scenarios"].append({"chunk": label, "precision": precision, "compute_s_per_layer": compute_s,
                                     "comm_s_per_layer": comm_s, "column_loop_s_per_layer": loop_s,
                                     "total_h": layer_s * moe_layers / 3600})
    out["cpu_achieved_gflops"] = rates
    return out


def work_split(src: Path, tokens: int) -> list[dict]:
    """CPU seconds of one MoE layer's expert GPTQ for rank 0's share in worlds of 1, 2 and 4 ranks, run one
    after the other in this process (1 thread): the per-rank work without two ranks competing for cores."""
    import torch

    from quantkit.calibrate import layers as L
    from quantkit.calibrate.experts import quantize_experts
    from quantkit.calibrate.gptq import GPTQScheme
    from quantkit.checkpoint.source import open_source
    from quantkit.core.distributed import SINGLE, World
    from quantkit.quant.recipe import GPTQSettings

    torch.set_num_threads(1)
    source = open_source(src)
    cfg = L.hf_config(source.config)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, tokens, cfg.hidden_size, generator=g)]
    out = []
    for size in (1, 2, 4):
        moe = L.build_layer(source, cfg, 1, "", World(0, size)).mlp
        moe.world = SINGLE  # rank 0's experts, fed every token directly (what the all-gather hands it)
        moe.start_collecting("all", keep_inputs=True)
        with torch.no_grad():
            for x in xs:
                moe(x)
        t = time.process_time()
        quantize_experts(moe, "x.", 1, GPTQScheme(32, 4, torch.bfloat16, GPTQSettings()))
        out.append({"world_size": size, "experts": len(moe.owned), "gptq_cpu_s": time.process_time() - t})
        print(f"work split: world {size}, rank 0 holds {len(moe.owned)} experts: expert GPTQ of one layer "
              f"{out[-1]['gptq_cpu_s']:.1f} CPU-s", flush=True)
    return out


def memory_per_rank(root: Path, toks: object, samples: int, seq: int) -> dict:
    """Peak RSS per rank, 1 vs 2 ranks, on a model whose experts dominate a layer (48 experts of 2048 x 1024,
    576 MiB per layer in bf16): forward passes only (no GPTQ), so the layers' weights are what differs."""
    from quantkit.checkpoint.synth import make_checkpoint

    src = make_checkpoint(root / "mem-src", "deepseek_v3", "bf16", size="bench", mtp=False, shards=2,
                          config_overrides={"num_hidden_layers": 3, "moe_intermediate_size": 2048,
                                            "n_routed_experts": 48})
    out: dict = {"experts": 48, "moe_intermediate": 2048, "hidden": 1024,
                 "expert_bytes_per_layer_mib": 48 * 3 * 2048 * 1024 * 2 / 2**20}
    for n in (1, 2):
        ranks = launch(n, src, root / f"mem-work-{n}", root / "tokens.safetensors", samples, seq, 1, roles="")
        out[f"{n}_ranks"] = [{"rank": r["rank"], "peak_rss_mib": r["peak_rss_mib"],
                              "rss_before_run_mib": r["rss_before_run_mib"]} for r in ranks]
        print(f"memory, {n} rank(s): " + ", ".join(
            f"rank{r['rank']} peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_rss_mib'] - r['rss_before_run_mib']:.0f}"
            " above its start)" for r in ranks), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (the first is dense)")
    ap.add_argument("--two-threads", action="store_true", help="also one process with 2 threads")
    ap.add_argument("--projection-only", action="store_true",
                    help="recompute the projection into the saved results (measured rates kept)")
    ap.add_argument("--memory-only", action="store_true", help="rerun the memory part into the saved results")
    a = ap.parse_args()
    if a.memory_only:
        import torch
        from safetensors.torch import save_file

        path = RESULTS / "distributed_gptq.json"
        result = json.loads(path.read_text())
        root = Path(tempfile.mkdtemp(prefix="qk-distgptq-"))
        toks = torch.randint(1, 8192, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
        save_file({"tokens": toks}, str(root / "tokens.safetensors"))
        result["memory"] = memory_per_rank(root, toks, a.samples, a.seq_len)
        path.write_text(json.dumps(result, indent=2) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        return
    if a.projection_only:
        path = RESULTS / "distributed_gptq.json"
        result = json.loads(path.read_text())
        result["projection_glm52_8xh200"] = projection(result["projection_glm52_8xh200"]["cpu_achieved_gflops"])
        path.write_text(json.dumps(result, indent=2) + "\n")
        _print_projection(result)
        return
    import torch
    from safetensors.torch import save_file

    from quantkit.checkpoint.synth import make_checkpoint

    RESULTS.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="qk-distgptq-"))
    src = make_checkpoint(root / "src", "deepseek_v3", "bf16", size="bench", mtp=False, shards=2,
                          config_overrides={"num_hidden_layers": a.layers})
    cfg = json.loads((src / "config.json").read_text())
    toks = torch.randint(1, cfg["vocab_size"], (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": toks}, str(root / "tokens.safetensors"))
    runs = {}
    configs = [("1 process x 1 thread", 1, 1), ("2 ranks x 1 thread", 2, 1)]
    if a.two_threads:
        configs.append(("1 process x 2 threads", 1, 2))
    for label, n, threads in configs:
        load = os.getloadavg()[0]  # the cores are shared with other work: say how busy they were
        ranks = launch(n, src, root / f"work-{n}-{threads}", root / "tokens.safetensors", a.samples, a.seq_len,
                       threads)
        runs[label] = {"wall_s": max(r["process_wall_s"] for r in ranks), "cpu_s": sum(r["cpu_s"] for r in ranks),
                       "calib_wall_s": max(r["calib_wall_s"] for r in ranks),
                       "calib_cpu_s": sum(r["calib_cpu_s"] for r in ranks),
                       "load_avg_before": load, "load_avg_after": os.getloadavg()[0], "ranks": ranks}
        print(f"{label:24} wall {runs[label]['wall_s']:6.1f}s cpu {runs[label]['cpu_s']:6.1f}s "
              f"(in run: wall {runs[label]['calib_wall_s']:.1f}s cpu {runs[label]['calib_cpu_s']:.1f}s) "
              f"(load {load:.1f})  "
              + "  ".join(f"rank{r['rank']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
                          + f", cpu {r['cpu_s']:.1f}s, peak RSS {r['peak_rss_mib']:.0f} MiB"
                          f" ({r['rss_before_run_mib']:.0f} before run)" for r in ranks), flush=True)
    split = work_split(src, a.samples * a.seq_len)
    memory = memory_per_rank(root, toks, a.samples, a.seq_len)
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    f = phase_flops(cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
                    a.samples * a.seq_len, cfg["num_experts_per_tok"], kept=True)
    base = runs["1 process x 1 thread"]["ranks"][0]["phases"]
    rates = {p: f[p] * moe_layers / base[p] / 1e9 for p in f if base.get(p)}
    one = runs["1 process x 1 thread"]["wall_s"]
    result = {
        "model": {k: cfg[k] for k in ("hidden_size", "moe_intermediate_size", "n_routed_experts",
                                      "num_hidden_layers", "first_k_dense_replace", "num_experts_per_tok")},
        "samples": a.samples, "seq_len": a.seq_len, "cpus": os.cpu_count(), "runs": runs,
        "speedup_2_ranks_vs_1x1": one / runs["2 ranks x 1 thread"]["wall_s"],
        "cpu_ratio_2_ranks_vs_1x1": runs["2 ranks x 1 thread"]["cpu_s"] / runs["1 process x 1 thread"]["cpu_s"],
        "calib_cpu_ratio_2_ranks_vs_1x1": (runs["2 ranks x 1 thread"]["calib_cpu_s"]
                                           / runs["1 process x 1 thread"]["calib_cpu_s"]),
        "flops_per_moe_layer": f,
        "work_split": split,
        "memory": memory,
        "projection_glm52_8xh200": projection(rates),
    }
    (RESULTS / "distributed_gptq.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    print(f"speed-up 2 ranks vs 1 process x 1 thread: {result['speedup_2_ranks_vs_1x1']:.2f}x (wall); "
          f"CPU seconds 2 ranks / 1 process: {result['cpu_ratio_2_ranks_vs_1x1']:.2f} "
          f"(inside run: {result['calib_cpu_ratio_2_ranks_vs_1x1']:.2f})")
    print("achieved GFLOP/s (1 process x 1 thread): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    _print_projection(result)


def _print_projection(result: dict) -> None:
    print("PROJECTION (not a measurement) GLM-5.2 GPTQ on 8xH200:")
    for s in result["projection_glm52_8xh200"]["scenarios"]:
        print(f"  {s['chunk']:42} {s['precision']:24} compute {s['compute_s_per_layer']:6.1f}s "
              f"comm {s['comm_s_per_layer']:4.1f}s loop {s['column_loop_s_per_layer']:5.1f}s /layer -> "
              f"{s['total_h']:.2f} h")


if __name__ == "__main__":
    main()
