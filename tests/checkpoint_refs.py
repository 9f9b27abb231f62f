"""Reference helpers the tests share (imported as `checkpoint_refs`, so that no test depends on which
`conftest` module pytest imported last): read a checkpoint, an independent fake-quantized reference built
only from compressed-tensors and safetensors (no quantkit code), loading in a fresh transformers process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EXPERT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def fake_quant_reference(src: Path, dst: Path, group_size: int = 32) -> Path:
    """A BF16 checkpoint whose routed experts are quantize-dequantized by compressed-tensors itself."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import save_file

    tensors = read_all(src)
    config = json.loads((src / "config.json").read_text())
    qc = config.pop("quantization_config", None) or {}
    if qc.get("quant_method") == "fp8":
        fp8 = [n.removesuffix(".weight_scale_inv") for n in tensors if n.endswith(".weight_scale_inv")]
        tensors = FP8BlockDequantizer(targets=fp8, weight_block_size=qc["weight_block_size"]).process(tensors)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    already_int4 = set()  # INT4 sources pass through: their values are the reference as they are
    for packed in [n for n in tensors if n.endswith(".weight_packed")]:
        m = packed.removesuffix(".weight_packed")
        state = {p: tensors.pop(f"{m}.{p}") for p in ("weight_packed", "weight_scale", "weight_shape")}
        tensors[f"{m}.weight"] = PackedQuantizationCompressor.decompress(
            state, QuantizationScheme(targets=["Linear"], weights=args))["weight"]
        already_int4.add(f"{m}.weight")
    for name in list(tensors):
        if EXPERT.search(name) and name not in already_int4:
            w = tensors[name].to(torch.bfloat16)
            grouped = w.unflatten(-1, (-1, group_size))
            scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
            tensors[name] = fake_quantize(w, scale, None, args)
    tensors = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 and "correction_bias" not in k else v).contiguous()
               for k, v in tensors.items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_LOADER = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
results = []
for ref, quant in json.loads(sys.argv[1]):
    a = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)
    b, info = AutoModelForCausalLM.from_pretrained(quant, dtype=torch.bfloat16, output_loading_info=True)
    ids = torch.randint(0, a.config.vocab_size, (2, 12))
    with torch.no_grad():
        la, lb = a(ids).logits.float(), b(ids).logits.float()
    results.append({"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                    "mismatched": [str(m) for m in info["mismatched_keys"]],
                    "max_abs_diff": (la - lb).abs().max().item(), "logit_scale": la.abs().max().item(),
                    "argmax_agree": (la.argmax(-1) == lb.argmax(-1)).float().mean().item()})
print("RESULT" + json.dumps(results))
"""


def load_in_fresh_process(pairs: list[tuple[Path, Path]]) -> list[dict]:
    """from_pretrained both dirs of each pair in a new interpreter; compare their logits."""
    proc = subprocess.run([sys.executable, "-c", _LOADER, json.dumps([[str(a), str(b)] for a, b in pairs])],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])
