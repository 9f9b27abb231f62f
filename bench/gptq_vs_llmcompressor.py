"""quantkit calibrated GPTQ vs llm-compressor `oneshot` GPTQ: quality on the tiny trained models, and wall
time + peak RSS on a generated MoE checkpoint big enough to matter (>= 1 GB).

    .venv/bin/python bench/gptq_vs_llmcompressor.py quality            # ~3 min on 2 cores
    .venv/bin/python bench/gptq_vs_llmcompressor.py quality --seeds 0 1 2 3 4 --arch deepseek_v3
    .venv/bin/python bench/gptq_vs_llmcompressor.py cost --variant "no refit"   # calibration CPU seconds
    .venv/bin/python bench/gptq_vs_llmcompressor.py speed              # ~15 min on 2 cores
    .venv/bin/python bench/gptq_vs_llmcompressor.py speed --layers 2   # quick smoke

Both tools get the same model, the same pre-tokenized samples, sequence length, scheme (W4A16, symmetric,
group 32, static act-order, damping 0.01, block 128), ignore list (everything but routed experts) and
thread count; each runs in its own fresh process, one after the other. Results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PY = sys.executable


def _timed(cmd: list[str], threads: int) -> dict[str, float]:
    """Run `cmd` in a fresh process; wall seconds, CPU seconds (user + system) and its output (which ends
    with its peak RSS)."""
    import resource

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        print(out[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return {"wall_s": wall, "cpu_s": cpu, "log": out[-2000:]}


def _rss_wrapper(code: str) -> list[str]:
    """A python -c command that runs `code` and prints its own peak RSS last (ru_maxrss, KiB on Linux)."""
    tail = "\nimport resource; print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    return [PY, "-c", code + tail]


def _peak(log: str, key: str = "PEAK_RSS_KIB") -> float:
    for line in reversed(log.splitlines()):
        if line.startswith(key):
            return int(line.split()[1]) / 2**20
    return float("nan")


# ------------------------------------------------------------------------------------------ quality
# GPTQ variants evaluated next to the default (recipe `gptq:` overrides); see docs/benchmarks.md
VARIANTS: dict[str, dict] = {
    "no refit": {"refit_scales": False},  # the default before scale refit
    "mse": {"scale_search": "mse"},
    "damp 0.001": {"dampening_frac": 0.001},
    "damp 0.1": {"dampening_frac": 0.1},
    "natural order": {"actorder": None},
    "unweighted": {"routed_token_weight": 0.0},
    "routed x3": {"routed_token_weight": 2.0},
    "routed x10": {"routed_token_weight": 9.0},
    "routed x3 + gate-up": {"routed_token_weight": 2.0, "routed_weight_gate_up": True},
    "mse + routed x3": {"scale_search": "mse", "routed_token_weight": 2.0},
    "asymmetric": {"asymmetric": True},
    "asymmetric 0.5": {"asymmetric": True, "asymmetric_strength": 0.5},
    "asymmetric 0.25": {"asymmetric": True, "asymmetric_strength": 0.25},
    "gate-up first": {"expert_order": "gate_up_first"},
    "asymmetric + gate-up first": {"asymmetric": True, "expert_order": "gate_up_first"},
    "asymmetric + routed x3": {"asymmetric": True, "routed_token_weight": 2.0},
    "asymmetric 0.5 + gate-up first": {"asymmetric": True, "asymmetric_strength": 0.5, "expert_order": "gate_up_first"},
    "asymmetric + gate-up first + routed x3": {"asymmetric": True, "expert_order": "gate_up_first",
                                               "routed_token_weight": 2.0},
    "gate-up first + routed x3": {"expert_order": "gate_up_first", "routed_token_weight": 2.0},
    "asymmetric + gate-up first + routed x3 + gate-up": {"asymmetric": True, "expert_order": "gate_up_first",
                                                          "routed_token_weight": 2.0, "routed_weight_gate_up": True},
    "asymmetric gate-up only": {"asymmetric": True, "asymmetric_down": False},
    "asymmetric gate-up only + gate-up first": {"asymmetric": True, "asymmetric_down": False,
                                                "expert_order": "gate_up_first"},
}


def quality(samples: int, seq_len: int, threads: int, variants: list[str] | None = None,
            archs: list[str] | None = None, seeds: list[int] | None = None) -> dict:
    """Both tools on the same calibration windows, for each calibration seed (the draw of the samples from the
    corpus). One seed is one comparison; on these tiny models the draw alone moves either tool's KL by
    +-15%, so several seeds and their geometric mean are the figure to trust."""
    from quantkit.calibrate.tiny import ARCHS

    results = {}
    for arch in archs or ARCHS:
        per_seed = {seed: _quality_one(arch, samples, seq_len, threads, variants, seed) for seed in seeds or [0]}
        names = list(next(iter(per_seed.values()))["kl_ratio_to_oneshot"])
        geo = {n: math.exp(sum(math.log(r["kl_ratio_to_oneshot"][n]) for r in per_seed.values()) / len(per_seed))
               for n in names}
        results[arch] = {"seeds": per_seed, "geomean_kl_ratio_to_oneshot": geo}
        if len(per_seed) > 1:
            print(f"\n{arch}: KL / oneshot per seed {list(per_seed)} and geometric mean")
            for n in names:
                ratios = " ".join(f"{r['kl_ratio_to_oneshot'][n]:.3f}" for r in per_seed.values())
                print(f"  {n:<40} {ratios}   geomean {geo[n]:.3f}")
    return {"samples": samples, "seq_len": seq_len, "threads": threads, "archs": results}


def _quality_one(arch: str, samples: int, seq_len: int, threads: int, variants: list[str] | None,
                 seed: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from quantkit.arch import Role
    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.eval import evaluate_in_subprocess
    from quantkit.calibrate.reference import ignore_list, oneshot_gptq
    from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny
    from quantkit.convert.pipeline import convert
    from quantkit.quant.recipe import Recipe

    torch.set_num_threads(threads)
    src = build_tiny(arch)
    root = Path(tempfile.mkdtemp(prefix=f"qk-quality-{arch}-"))
    calib = {"dataset": str(CORPUS), "samples": samples, "seq_len": seq_len, "seed": seed}
    t = time.perf_counter()
    convert(src, root / "gptq", Recipe(method="gptq", calibration=calib))
    t_gptq = time.perf_counter() - t
    convert(src, root / "rtn", Recipe(method="rtn"))
    seconds = {}
    for name in variants or []:
        t = time.perf_counter()
        convert(src, root / name, Recipe(method="gptq", calibration=calib, gptq=VARIANTS[name]))
        seconds[name] = time.perf_counter() - t
    tokens = calibration_tokens(CORPUS, AutoTokenizer.from_pretrained(src), samples, seq_len, seed)
    config = json.loads((src / "config.json").read_text())
    t = time.perf_counter()
    oneshot_gptq(src, root / "oneshot", tokens, ignore_list(config, {Role.ROUTED_EXPERT}))
    t_oneshot = time.perf_counter() - t
    names = ["rtn", "gptq", "oneshot", *(variants or [])]
    ev = evaluate_in_subprocess([root / n for n in names], HELDOUT, src, 128, 64, threads)
    rows = {"source": ev["reference"]}
    for name in names:
        rows[name] = ev["models"][str(root / name)]
    result = {"seed": seed, "eval_tokens": ev["tokens"], "rows": rows,
              "seconds": {"gptq": t_gptq, "oneshot": t_oneshot, **seconds},
              "kl_ratio_to_oneshot": {n: rows[n]["kl_mean"] / rows["oneshot"]["kl_mean"]
                                      for n in names if n != "oneshot"},
              "wall_ratio_to_oneshot": round(t_gptq / t_oneshot, 3)}
    shutil.rmtree(root, ignore_errors=True)
    _print_quality(f"{arch} seed {seed}", result)
    return result


def cost(threads: int, variants: list[str], reps: int, speed_tokens: tuple[int, int] = (8, 256)) -> dict:
    """CPU seconds of calibration alone (`calibrate.runner.run` on pre-tokenized windows, the checkpoint not
    written), the default and each variant alternated in one process after a warm-up run; median of `reps`.
    On the tiny deepseek_v3 of the quality benchmark (32 x 128 tokens) and on a 2-layer random deepseek_v3 of
    the speed benchmark (64 experts of 512 x 1024, `speed_tokens` samples x length: 8 x 256 by default)."""
    import statistics

    import torch
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.runner import RunOptions, run
    from quantkit.calibrate.tiny import CORPUS, build_tiny
    from quantkit.checkpoint.source import open_source
    from quantkit.quant.recipe import Recipe

    torch.set_num_threads(threads)
    root = Path(tempfile.mkdtemp(prefix="qk-cost-"))
    models = {"tiny deepseek_v3 (32 x 128 tokens)": (build_tiny("deepseek_v3"), 32, 128, reps),
              f"random deepseek_v3, 2 layers ({speed_tokens[0]} x {speed_tokens[1]} tokens)":
                  (root / "speed", *speed_tokens, max(1, reps // 3))}
    make_checkpoint(root / "speed", 2)
    out = {}
    for label, (src, samples, seq_len, n) in models.items():
        source = open_source(src)
        tokens = calibration_tokens(CORPUS, AutoTokenizer.from_pretrained(src), samples, seq_len, 0)
        calib = {"samples": samples, "seq_len": seq_len, "seed": 0}
        names = ["default", *variants]
        recipes = {nm: Recipe(method="gptq", calibration=calib, gptq=VARIANTS.get(nm, {})) for nm in names}
        cpu: dict[str, list[float]] = {nm: [] for nm in names}
        for rep in range(n + 1):  # rep 0 warms up (imports, first-call allocations)
            for nm in names:
                work = root / "work"
                shutil.rmtree(work, ignore_errors=True)
                t = time.process_time()
                run(source, recipes[nm], work, None, RunOptions(tokens=tokens, threads=threads, device="cpu"))
                if rep:
                    cpu[nm].append(time.process_time() - t)
        med = {nm: statistics.median(v) for nm, v in cpu.items()}
        out[label] = {"cpu_s": cpu, "median_cpu_s": med,
                      "ratio_to_default": {nm: med[nm] / med["default"] for nm in names}}
        print(f"\n{label}: calibration CPU s, median of {n}")
        for nm in names:
            print(f"  {nm:<40} {med[nm]:8.2f}   x{med[nm] / med['default']:.3f}")
    shutil.rmtree(root, ignore_errors=True)
    return {"threads": threads, "reps": reps, "models": out}


def _print_quality(arch: str, r: dict) -> None:
    print(f"\n{arch} ({r['eval_tokens']} held-out tokens)")
    print(f"{'model':<18}{'ppl':>10}{'KL vs src':>12}{'KL/oneshot':>11}{'top-1':>9}{'wall s':>8}")
    for name, e in r["rows"].items():
        kl = f"{e['kl_mean']:.3e}" if "kl_mean" in e else "-"
        ratio = f"{r['kl_ratio_to_oneshot'][name]:.3f}" if name in r["kl_ratio_to_oneshot"] else "-"
        top = f"{e['top1_agreement']:.2%}" if "top1_agreement" in e else "-"
        wall = f"{r['seconds'][name]:.1f}" if name in r["seconds"] else "-"
        print(f"{name:<18}{e['perplexity']:>10.4f}{kl:>12}{ratio:>11}{top:>9}{wall:>8}")


# -------------------------------------------------------------------------------------------- speed
def make_checkpoint(path: Path, layers: int) -> dict:
    """A random deepseek_v3 MoE (bf16, per-expert tensors on disk) of about 0.2 GB per layer + tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.calibrate.tiny import build_tokenizer

    if (path / "config.json").exists():
        return json.loads((path / "config.json").read_text())
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=512, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
        kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=64,
        num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
        num_nextn_predict_layers=0, tie_word_embeddings=False, max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="500MB")
    build_tokenizer(path)
    return json.loads((path / "config.json").read_text())


def speed(layers: int, samples: int, seq_len: int, threads: int, keep: Path | None,
          only: list[str] | None = None) -> dict:
    root = keep or Path(tempfile.mkdtemp(prefix="qk-speed-"))
    src = root / "src"
    config = make_checkpoint(src, layers)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    common = (
        "import torch, json\n"
        f"torch.set_num_threads({threads})\n"
        "from transformers import AutoTokenizer\n"
        "from quantkit.calibrate.data import calibration_tokens\n"
        f"tok = AutoTokenizer.from_pretrained({str(src)!r})\n"
        f"tokens = calibration_tokens({str(REPO / 'calibration_data/default.jsonl')!r}, tok, {samples}, {seq_len}, 0)\n"
    )
    # quantkit's peak above its own runtime baseline: after the imports and the tokenizer run, the kernel's
    # high-water mark is reset (Linux clear_refs 5) and the resident size then is the baseline
    ours = common + (
        "from quantkit.convert.pipeline import convert\nfrom quantkit.quant.recipe import Recipe\n"
        "import numba, transformers.models.deepseek_v3.modeling_deepseek_v3, gc\n"
        "from quantkit.calibrate.runner import calibrate\n"
        f"r = Recipe(method='gptq', calibration={{'dataset': {str(REPO / 'calibration_data/default.jsonl')!r}, "
        f"'samples': {samples}, 'seq_len': {seq_len}, 'seed': 0}})\n"
        "gc.collect(); open('/proc/self/clear_refs', 'w').write('5')\n"
        "status = lambda key: int([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith(key)][0])\n"
        "print('BASE_RSS_KIB', status('VmRSS:'))\n"
        f"convert({str(src)!r}, {str(root / 'ours')!r}, r, force=True)\n"
        "print('HWM_RSS_KIB', status('VmHWM:'))\n"
    )
    # GPTQ alone on the pre-tokenized windows (the tokenizer's transient memory outside the measurement)
    gptq_only = common + (
        "from pathlib import Path\nfrom quantkit.checkpoint.source import open_source\n"
        "from quantkit.calibrate.runner import RunOptions, run\nfrom quantkit.quant.recipe import Recipe\n"
        "import gc, numba, shutil, transformers.models.deepseek_v3.modeling_deepseek_v3\n"
        f"r = Recipe(method='gptq', calibration={{'samples': {samples}, 'seq_len': {seq_len}, 'seed': 0}})\n"
        f"shutil.rmtree({str(root / 'gptq')!r}, ignore_errors=True)\n"
        f"source = open_source({str(src)!r})\n"
        "gc.collect(); open('/proc/self/clear_refs', 'w').write('5')\n"
        "status = lambda key: int([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith(key)][0])\n"
        "print('BASE_RSS_KIB', status('VmRSS:'))\n"
        f"res = run(source, r, Path({str(root / 'gptq')!r}), print, RunOptions(tokens=tokens, threads={threads}))\n"
        "print('HWM_RSS_KIB', status('VmHWM:'))\nprint(res.summary())\n"
    )
    calib_only = common + (
        "from pathlib import Path\nfrom quantkit.checkpoint.source import open_source\n"
        "from quantkit.calibrate.runner import calibrate\nfrom quantkit.quant.recipe import Recipe\n"
        f"r = Recipe(method='gptq', calibration={{'dataset': {str(REPO / 'calibration_data/default.jsonl')!r}, "
        f"'samples': {samples}, 'seq_len': {seq_len}, 'seed': 0}})\n"
        f"import shutil; shutil.rmtree({str(root / 'calib')!r}, ignore_errors=True)\n"
        f"print(calibrate(open_source({str(src)!r}), r, Path({str(root / 'calib')!r}), print).summary())\n"
    )
    theirs = common + (
        "from quantkit.arch import Role\nfrom quantkit.calibrate.reference import ignore_list, oneshot_gptq\n"
        f"cfg = json.load(open({str(src / 'config.json')!r}))\n"
        f"oneshot_gptq({str(src)!r}, {str(root / 'oneshot')!r}, tokens, ignore_list(cfg, {{Role.ROUTED_EXPERT}}))\n"
    )
    # the runtime baseline: the same interpreter, imports, tokenizer and tokens, no model work
    baseline = common + (
        "import numba, transformers.models.deepseek_v3.modeling_deepseek_v3\n"
        "from quantkit.convert.pipeline import convert\nfrom quantkit.calibrate.runner import calibrate\n"
    )
    res = {}
    runs = (("baseline", baseline), ("quantkit", ours), ("quantkit gptq only", gptq_only),
            ("quantkit calibrate only", calib_only), ("llm-compressor", theirs))
    for name, code in runs if not only else [r for r in runs if r[0] in only]:
        shutil.rmtree(root / ("ours" if name == "quantkit" else "oneshot"), ignore_errors=True)
        r = _timed(_rss_wrapper(code), threads)
        res[name] = {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "peak_rss_gib": _peak(r["log"])}
        if "BASE_RSS_KIB" in r["log"]:
            res[name]["baseline_rss_gib"] = _peak(r["log"], "BASE_RSS_KIB")
            res[name]["peak_after_baseline_gib"] = _peak(r["log"], "HWM_RSS_KIB")
        (RESULTS / f"speed_{name.replace(' ', '_')}.log").write_text(r["log"])
        print(f"{name:<15} wall {r['wall_s']:8.1f} s   CPU {r['cpu_s']:8.1f} s   peak RSS "
              f"{res[name]['peak_rss_gib']:6.2f} GiB", flush=True)
    from quantkit.checkpoint.source import open_source

    hidden = config["hidden_size"]
    layer_params = sum(math.prod(t.shape) for n, t in open_source(src).logical.items()
                       if n.startswith("model.layers.1."))  # every tensor of one decoder layer
    acts = samples * seq_len * hidden * 4 * 2  # fp32 inputs + outputs of the calibration set
    budget = layer_params * 2 + acts  # one layer in bf16 + activations
    out = {
        "checkpoint_gb": size / 1e9, "layers": layers, "samples": samples, "seq_len": seq_len, "threads": threads,
        "one_layer_params": layer_params, "one_layer_bf16_gib": layer_params * 2 / 2**30,
        "one_layer_fp32_gib": layer_params * 4 / 2**30, "activations_in_out_gib": acts / 2**30, **res,
    }
    for r in res.values():
        if "baseline_rss_gib" in r:
            above = (r["peak_after_baseline_gib"] - r["baseline_rss_gib"]) * 2**30
            r["above_baseline_gib"] = above / 2**30
            r["above_baseline_over_layer_bf16_plus_acts"] = above / budget
    if "quantkit" in res and "llm-compressor" in res:
        out["wall_ratio"] = res["quantkit"]["wall_s"] / res["llm-compressor"]["wall_s"]
    if keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["quality", "speed", "cost"])
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", type=Path, default=None, help="reuse/keep the generated checkpoint here")
    ap.add_argument("--only", action="append", help="run only these (quantkit, 'quantkit calibrate only', ...)")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS),
                    help="quality: also evaluate this GPTQ variant (repeatable)")
    ap.add_argument("--arch", action="append", help="quality: only these tiny models (deepseek_v3, glm_moe_dsa)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="quality: calibration seeds (both tools)")
    ap.add_argument("--reps", type=int, default=5, help="cost: measured repetitions (after one warm-up)")
    ap.add_argument("--speed-tokens", type=int, nargs=2, default=[8, 256], metavar=("SAMPLES", "SEQ_LEN"),
                    help="cost: calibration windows of the random model")
    a = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if a.what == "quality":
        res = quality(a.samples or 32, a.seq_len or 128, a.threads, a.variant, a.arch, a.seeds)
    elif a.what == "cost":
        res = cost(a.threads, a.variant or [], a.reps, tuple(a.speed_tokens))
    else:
        res = speed(a.layers, a.samples or 8, a.seq_len or 256, a.threads, a.keep, a.only)
    name = f"calibration_{a.what}" + ("_" + "_".join(x.replace(" ", "-") for x in a.only) if a.only else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "archs"}, indent=2))


if __name__ == "__main__":
    main()
