"""FP4 conversion: the engines' fused groups, the global-scale pre-pass, and quantizing one tensor.

NVFP4's `weight_global_scale` is per tensor on disk, but SGLang and vLLM load some Linears into one fused
parameter with one global scale: gate_proj/up_proj (per routed expert, the shared experts and dense MLPs),
MLA's q_a_proj/kv_a_proj_with_mqa and GQA's q/k/v_proj. The scale of such a group must be computed from the
amax over all its members (what llm-compressor's calibrated `oneshot` does with fused observers; its
data-free `model_free_ptq` misses the MoE and MLA names, docs/fp4.md). So an NVFP4 conversion makes one
pre-pass over the quantized members of fused groups before any shard is written: each tensor is read,
dequantized to the model dtype and reduced to its amax, one tensor at a time (memory: one tensor in the
model dtype plus its fp32 copy in the FP8 case, as a shard worker; time: one more read of ~2/3 of the
routed-expert bytes). The per-group amaxes go to `OUT.partial/journal/fp4_amax.json`, so a resumed run
skips the pre-pass and writes the same bytes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quantkit.checkpoint.source import LogicalTensor, SourceCheckpoint
from quantkit.convert.plan import TensorPlan
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.quant import fused
from quantkit.quant.fp4 import (
    PackedFP4,
    fused_group,
    fused_groups,
    mxfp4_quantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    tensor_amax,
)

__all__ = ["AMAX_FILE", "fused_group", "fused_groups", "group_amax", "input_group_amax", "quantize_fp4_tensor",
           "read_model_dtype"]

AMAX_FILE = "fp4_amax.json"
def read_model_dtype(source: SourceCheckpoint, t: LogicalTensor) -> torch.Tensor:
    """The logical weight in the model dtype on the CPU, as the peer sees it: FP8-block dequantized to bf16
    (fp32 product, rounded once), INT4 dequantized, plain weights cast. NaN/Inf raise a one-line error."""
    dtype = source.model_dtype
    if t.fmt == "fp8_block" and dtype == torch.bfloat16 and fused.available():
        value, bad = fused.dequant_fp8_block_bf16(*source.fp8_parts(t), source.fp8_block_size)
    else:
        stored = source.read_physical(t.name, t.shard) if t.fmt == "plain" else None
        if stored is not None and stored.dtype == dtype:
            value = stored
        else:
            value = source.read(t.name, torch.float32, check_finite=False).to(dtype)
        bad = fused.count_nonfinite(value)
    if bad:
        raise QuantkitError(f"{source.root / t.shard}: tensor {t.name} contains NaN or Inf values")
    return value


def group_amax(source: SourceCheckpoint, plans: dict[str, list[TensorPlan]], work_dir: Path,
               workers: int = 1) -> dict[str, float]:
    """Module -> the amax of its fused group (modules of two-member-or-more groups only), from the journal file
    when an earlier run of the same identity wrote it, else by the pre-pass (one tensor at a time per worker)."""
    path = work_dir / "journal" / AMAX_FILE
    quantized = {p.module: p for ps in plans.values() for p in ps if p.action == "quantize"}
    groups = fused_groups(list(quantized))
    if path.exists():
        saved = json.loads(path.read_text())
        if set(saved) == set(groups):
            return {m: float(saved[g]) for g, ms in groups.items() for m in ms}
    members = [m for ms in groups.values() for m in ms]

    def amax(module: str) -> float:
        return float(tensor_amax(read_model_dtype(source, quantized[module].source)))

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="quantkit-amax") as pool:
        per_module = dict(zip(members, pool.map(amax, members), strict=True))
    per_group = {g: max(per_module[m] for m in ms) for g, ms in groups.items()}
    write_json_atomic(path, per_group)
    return {m: per_group[g] for g, ms in groups.items() for m in ms}


def input_group_amax(modules: list[str], observed: dict[str, float]) -> dict[str, float]:
    """NVFP4 W4A4: module -> the activation amax its `input_global_scale` comes from: the max over its fused group
    of the calibration's observed input amaxes (`quantkit.calibrate.act_amax`).

    Fallback for a module without an observation (an expert no token reached when experts see only routed
    tokens, an MTP layer the calibration does not run): the max over the same projection of that layer's
    experts, else over the same projection in the whole model (the widest range seen: clipping is avoided at
    the cost of resolution). Neither found: a one-line error."""
    def proj(m: str) -> str:
        return m.rsplit(".", 1)[-1]

    def layer_experts(m: str) -> str:
        return m.split(".experts.")[0] if ".experts." in m else m

    seen = {m: a for m, a in observed.items() if a > 0}
    by_proj: dict[str, float] = {}
    by_layer_proj: dict[tuple[str, str], float] = {}
    for m, a in seen.items():
        by_proj[proj(m)] = max(by_proj.get(proj(m), 0.0), a)
        if ".experts." in m:
            key = (layer_experts(m), proj(m))
            by_layer_proj[key] = max(by_layer_proj.get(key, 0.0), a)
    own: dict[str, float] = {}
    for m in modules:
        a = seen.get(m) or by_layer_proj.get((layer_experts(m), proj(m))) or by_proj.get(proj(m))
        if a is None:
            raise QuantkitError(f"calibration: no activation amax for {m} (nor for any {proj(m)}); scheme nvfp4 "
                                "needs one per quantized Linear")
        own[m] = a
    groups = fused_groups(modules)
    out = dict(own)
    for ms in groups.values():
        shared = max(own[m] for m in ms)
        out.update(dict.fromkeys(ms, shared))
    return out


def quantize_fp4_tensor(source: SourceCheckpoint, plan: TensorPlan, scheme: str) -> PackedFP4:
    """One weight in NVFP4 (global scale from its fused group's amax, else its own) or MXFP4."""
    weight = read_model_dtype(source, plan.source)
    if scheme == "mxfp4":
        return mxfp4_quantize(weight)
    amax = tensor_amax(weight) if plan.group_amax is None else torch.tensor(plan.group_amax)
    packed = nvfp4_quantize(weight, nvfp4_global_scale(amax, weight.dtype))
    if plan.input_amax is not None:  # W4A4: 2688 / activation amax, in the model dtype as CT's generate_gparam
        packed.input_global_scale = nvfp4_global_scale(plan.input_amax, weight.dtype)
    return packed
