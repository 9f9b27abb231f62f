"""Held-out quality of small models: perplexity, and divergence from the source model.

    quantkit eval MODEL [--reference SRC] [--data FILE] [--json]

Runs in a fresh Python process (clean memory, no state from the conversion). Quantized checkpoints
(compressed-tensors INT4, FP8-block) are dequantized to fp32 on load with quantkit's own source reader,
then run through transformers — the same forward for every model, so differences are the weights'.

Per quality.md the primary measure on tiny models is the mean per-token KL(source || model) of the
next-token distributions and the top-1 agreement; perplexity is reported alongside.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from quantkit.quant.int4 import PackedInt4

__all__ = ["evaluate", "evaluate_in_subprocess", "load_model", "fake_quantized_copy"]


def load_model(path: Path) -> PreTrainedModel:
    """A transformers causal LM (fp32) from a plain or quantized checkpoint directory."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from quantkit.checkpoint.source import open_source

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    if not config.get("quantization_config"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    source = open_source(path)
    with tempfile.TemporaryDirectory(prefix="quantkit-eval-") as tmp:
        tensors = {n: source.read(n, torch.float32) for n in source.logical_names() if not _is_scale(n)}
        save_file(tensors, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        Path(tmp, "config.json").write_text(json.dumps(plain), encoding="utf-8")
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def _is_scale(name: str) -> bool:
    return name.endswith((".k_scale", ".v_scale", ".input_scale"))


def heldout_tokens(data: Path, tokenizer_dir: Path, seq_len: int, windows: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import load_records, tokenize_windows

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tokenize_windows(load_records(data), tok, seq_len, seed=0)[:windows]


@torch.no_grad()
def _log_probs(model: PreTrainedModel, tokens: torch.Tensor, batch: int = 8) -> torch.Tensor:
    out = []
    for i in range(0, tokens.shape[0], batch):
        logits = model(input_ids=tokens[i : i + batch]).logits[:, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)


def evaluate(models: list[Path], data: Path, reference: Path | None = None, seq_len: int = 128,
             windows: int = 64) -> JSONObject:
    """Perplexity of each model on `data`; with `reference`, also KL(reference || model) and top-1."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    first = reference or models[0]
    tokens = heldout_tokens(data, first, seq_len, windows)
    target = tokens[:, 1:]
    ref_lp = _log_probs(load_model(reference), tokens) if reference else None
    results: JSONObject = {"data": str(data), "tokens": int(target.numel()), "seq_len": seq_len, "models": {}}
    if ref_lp is not None:
        results["reference"] = {"path": str(reference), **_ppl(ref_lp, target)}
    for path in models:
        lp = _log_probs(load_model(path), tokens)
        entry = _ppl(lp, target)
        if ref_lp is not None:
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
            entry["kl_mean"] = float(kl.mean())
            entry["top1_agreement"] = float((ref_lp.argmax(-1) == lp.argmax(-1)).float().mean())
        results["models"][str(path)] = entry
    return results


def _ppl(lp: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    nll = -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return {"perplexity": math.exp(float(nll.mean())), "nll": float(nll.mean())}


def evaluate_in_subprocess(models: list[Path], data: Path, reference: Path | None = None, seq_len: int = 128,
                           windows: int = 64, threads: int = 2) -> JSONObject:
    """`evaluate` in a fresh Python process; returns its JSON."""
    cmd = [sys.executable, "-m", "quantkit.calibrate.eval", *map(str, models), "--data", str(data),
           "--seq-len", str(seq_len), "--windows", str(windows), "--json"]
    if reference:
        cmd += ["--reference", str(reference)]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise QuantkitError(f"eval failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def format_table(res: JSONObject) -> str:
    lines = [f"held-out data: {res['data']} ({res['tokens']} tokens)"]
    if "reference" in res:
        lines.append(f"{'reference':<40} ppl {res['reference']['perplexity']:8.3f}")
    for path, e in res["models"].items():
        extra = f"  KL {e['kl_mean']:.2e}  top-1 {e['top1_agreement']:.2%}" if "kl_mean" in e else ""
        lines.append(f"{Path(path).name:<40} ppl {e['perplexity']:8.3f}{extra}")
    return "\n".join(lines)


# ------------------------------------------------------------------------- quality-test helper
def fake_quantized_copy(src: Path, out: Path, quantized: Callable[[str], PackedInt4 | None], group_size: int,
                        roles: set[str]) -> None:
    """A plain (dequantized) copy of `src` where every Linear of `roles` is replaced by its INT4 value:
    `quantized(module) -> PackedInt4 | None` (None = RTN). Used to measure quality without the converter."""
    import shutil

    from safetensors.torch import save_file

    from quantkit.checkpoint.source import open_source
    from quantkit.quant.int4 import dequantize_group, quantize_rtn, unpack_int4

    source = open_source(src)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name in source.logical_names():
        w = source.read(name, torch.float32)
        info = source.adapter.classify(name)
        if info.role.value in roles and name.endswith(".weight") and w.ndim == 2:
            p = quantized(name[: -len(".weight")])
            if p is None:
                q, s = quantize_rtn(w, group_size)
            else:
                q, s = unpack_int4(p.weight_packed, tuple(w.shape)), p.weight_scale
            w = dequantize_group(q, s, group_size)
        tensors[name] = w.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for p in src.iterdir():
        if p.suffix != ".safetensors" and p.is_file() and p.name != "model.safetensors.index.json":
            shutil.copy2(p, out / p.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m quantkit.calibrate.eval")
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--reference", type=Path)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = evaluate(a.models, a.data, a.reference, a.seq_len, a.windows)
    print(json.dumps(res) if a.json else format_table(res))


if __name__ == "__main__":
    main()
