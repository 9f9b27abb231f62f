"""Fast in-process KL exploration of GPTQ settings on the tiny trained models (no checkpoint written).

    .venv/bin/python bench/gptq_kl_explore.py variants '{}' '{"refit_scales": false}' --seeds 0 1 2
    .venv/bin/python bench/gptq_kl_explore.py layers '{"refit_scales": false}' --seed 0

`variants`: for each calibration seed, calibrate with each recipe `gptq:` block (JSON), put the dequantized
routed experts into a copy of the source model and measure the mean per-token KL(source || model) on the
held-out windows of the quality benchmark; prints each variant's KL over the first variant's at the same seed
and the geometric mean over seeds. `layers`: the KL when only one layer's (or one expert's) routed experts are
quantized (with the first settings given) — where the error of the whole model comes from.

This measures quantkit alone, relative to itself; the comparison with llm-compressor is
`gptq_vs_llmcompressor.py quality` (same models, windows and evaluation).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from quantkit.calibrate.data import calibration_tokens
from quantkit.calibrate.eval import _log_probs, heldout_tokens, load_model
from quantkit.calibrate.runner import RunOptions, run
from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny
from quantkit.checkpoint.source import open_source
from quantkit.quant.int4 import PackedInt4, dequantize_group, unpack_int4
from quantkit.quant.recipe import Recipe

Packed = Callable[[str], PackedInt4 | None]


class Bench:
    """One tiny model, its held-out reference log-probs, and calibration windows per seed."""

    def __init__(self, arch: str, samples: int = 32, seq_len: int = 128) -> None:
        from transformers import AutoTokenizer

        self.src = build_tiny(arch)
        self.source = open_source(self.src)
        self.tok = AutoTokenizer.from_pretrained(self.src)
        self.samples, self.seq_len = samples, seq_len
        self.model = load_model(self.src)
        self.windows = heldout_tokens(HELDOUT, self.src, 128, 64)
        self.ref = _log_probs(self.model, self.windows)
        self.group_size = Recipe().group_size

    def calibrate(self, gptq: dict, seed: int) -> tuple[Packed, tempfile.TemporaryDirectory]:
        calib = {"dataset": str(CORPUS), "samples": self.samples, "seq_len": self.seq_len, "seed": seed}
        tokens = calibration_tokens(CORPUS, self.tok, self.samples, self.seq_len, seed)
        work = tempfile.TemporaryDirectory(prefix="qk-explore-")
        res = run(self.source, Recipe(method="gptq", calibration=calib, gptq=gptq), Path(work.name), None,
                  RunOptions(tokens=tokens, threads=1, device="cpu"))
        return res.quantized, work

    def kl(self, packed: Packed) -> float:
        """KL(source || source with these modules' INT4 values) on the held-out windows."""
        model = copy.deepcopy(self.model)
        with torch.no_grad():
            for name, w in model.state_dict().items():
                if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    continue  # transformers fuses the per-expert checkpoint tensors into [experts, out, in]
                base = name.rsplit(".", 1)[0]
                projs = ("down_proj",) if name.endswith("down_proj") else ("gate_proj", "up_proj")
                rows = w.shape[1] // len(projs)
                for e in range(w.shape[0]):
                    for j, proj in enumerate(projs):
                        p = packed(f"{base}.{e}.{proj}")
                        if p is not None:
                            q = unpack_int4(p.weight_packed, (rows, w.shape[2]))
                            w[e, j * rows:(j + 1) * rows] = dequantize_group(q, p.weight_scale, self.group_size)
        lp = _log_probs(model, self.windows)
        return float((self.ref.exp() * (self.ref - lp)).sum(-1).mean())


def variants(bench: Bench, specs: list[str], seeds: list[int]) -> None:
    ratios: dict[str, list[float]] = {s: [] for s in specs}
    for seed in seeds:
        first = None
        for spec in specs:
            packed, work = bench.calibrate(json.loads(spec), seed)
            kl = bench.kl(packed)
            work.cleanup()
            first = first or kl
            ratios[spec].append(kl / first)
            print(f"seed {seed}  {spec:<60} KL {kl:.4e}  / first {kl / first:.3f}", flush=True)
    for spec, r in ratios.items():
        geo = math.exp(sum(map(math.log, r)) / len(r))
        print(f"geomean {geo:.3f}  ({' '.join(f'{x:.3f}' for x in r)})  {spec}")


def layers(bench: Bench, spec: str, seed: int) -> None:
    packed, work = bench.calibrate(json.loads(spec), seed)
    n = bench.source.adapter.num_layers
    print(f"all layers: KL {bench.kl(packed):.3e}")
    for layer in range(n):
        def one(m: str, layer: int = layer) -> PackedInt4 | None:
            return packed(m) if f".layers.{layer}." in m else None
        print(f"layer {layer} only: KL {bench.kl(one):.3e}", flush=True)
    work.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["variants", "layers"])
    ap.add_argument("specs", nargs="*", default=["{}"], help="variants: recipe gptq blocks as JSON; first = reference")
    ap.add_argument("--arch", default="deepseek_v3")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    bench = Bench(a.arch)
    if a.what == "variants":
        variants(bench, a.specs, a.seeds)
    else:
        layers(bench, a.specs[0], a.seed)


if __name__ == "__main__":
    main()
