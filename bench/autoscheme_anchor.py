"""AutoRound 0.16.1 AutoScheme on quantkit's tiny trained deepseek_v3 (the issue-29 peer anchor).

Started by bench/mixed_vs_autoscheme.py. Runs in its own venv, made once with:

    python3.11 -m venv /work/venvs/autoround
    /work/venvs/autoround/bin/pip install torch==2.13.0   # the CPU build first (the Makefile's wheel), then:
    /work/venvs/autoround/bin/pip install auto-round==0.16.1

    OMP_NUM_THREADS=2 /work/venvs/autoround/bin/python autoscheme_anchor.py SRC CALIB_JSON OUT \
        [--avg-bits 7.96] [--iters 200] [--format fake|llm_compressor|auto_round]

- SRC: the tiny model dir (quantkit.calibrate.tiny.build_tiny("deepseek_v3"), a transformers checkpoint).
- CALIB_JSON: a JSON list of strings (quantkit's own 32 x 128 calibration windows, decoded: make_calib_text.py);
  AutoScheme only takes a dataset *name/path* string, and its local loader wants text.
- options: INT4 W4A16 g32 and INT8 W8A16 g32 (symmetric int, bf16 scales), routed experts only (everything else
  passed in ignore_layers, so it stays BF16 and is not an AutoScheme target).
- AutoScheme scoring: its defaults (method "default" = delta loss, low_gpu_mem_usage) except dataset / nsamples /
  seqlen, set to the same 32 x 128 windows quantkit's GPTQ uses; then AutoRound's default SignRound tuning
  (iters=200, lr 1/iters, minmax lr ...) on the same windows.
Writes OUT/<format>/ (the quantized checkpoint), OUT/layer_config.json (what AutoScheme chose per layer) and
OUT/timing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("calib")
    ap.add_argument("out", type=Path)
    ap.add_argument("--avg-bits", type=float, default=7.96)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--format", default="fake")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--uniform-int4", action="store_true", help="no AutoScheme: uniform W4A16 g32 (same tuning)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))

    from auto_round import AutoRound, AutoScheme
    from auto_round.schemes import QuantizationScheme

    int4 = QuantizationScheme.from_dict({"bits": 4, "group_size": 32, "sym": True, "data_type": "int",
                                         "act_bits": 16})
    int8 = QuantizationScheme.from_dict({"bits": 8, "group_size": 32, "sym": True, "data_type": "int",
                                         "act_bits": 16})
    scheme = AutoScheme(avg_bits=a.avg_bits, options=[int4, int8], nsamples=a.samples, seqlen=a.seq_len,
                        dataset=a.calib)
    if a.uniform_int4:
        scheme = int4
    t0 = time.perf_counter()
    ar = AutoRound(a.src, scheme=scheme, dataset=a.calib, nsamples=a.samples, seqlen=a.seq_len, iters=a.iters,
                   batch_size=8, device_map="cpu", ignore_layers="self_attn,shared_experts", seed=42)
    t1 = time.perf_counter()
    model, layer_config = ar.quantize()
    t2 = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    ar.save_quantized(str(a.out / a.format), format=a.format)
    t3 = time.perf_counter()
    chosen = {}
    for name, cfg in sorted(layer_config.items()):
        if isinstance(cfg, dict):
            chosen[name] = {k: cfg.get(k) for k in ("bits", "group_size", "sym", "data_type", "act_bits")}
    (a.out / "layer_config.json").write_text(json.dumps(chosen, indent=1) + "\n")
    timing = {"init_s": t1 - t0, "quantize_s": t2 - t1, "save_s": t3 - t2, "total_s": t3 - t0,
              "avg_bits": a.avg_bits, "iters": a.iters, "samples": a.samples, "seq_len": a.seq_len,
              "threads": a.threads}
    (a.out / "timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    per_layer: dict[str, set] = {}
    for name, cfg in chosen.items():
        if ".experts." in name:
            per_layer.setdefault(name.split(".experts.")[0], set()).add(cfg["bits"])
    print("CHOSEN", {k: sorted(v) for k, v in per_layer.items()})
    print("TIMING", json.dumps(timing))


if __name__ == "__main__":
    main()
