"""What a calibration run hands the converter: packed GPTQ modules, KV scales, reports, a summary.

Everything is read back from the per-layer files in the work directory, so a resumed run and an
uninterrupted one produce the same result object. A layer calibrated by several ranks keeps each rank's
packed modules in a part file its layer file lists; every rank can load the result, whatever the world
size that made each layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from quantkit.arch import Adapter
from quantkit.calibrate.kv import KV_CACHE_SCHEME, KVStats, kv_report, resolve_scales
from quantkit.core.durable import write_json_atomic
from quantkit.quant.int4 import PackedInt4
from quantkit.quant.recipe import Recipe

__all__ = ["CalibrationResult", "COVERAGE_FILE", "KV_REPORT_FILE"]

COVERAGE_FILE = "calibration_coverage.json"
KV_REPORT_FILE = "kv_cache_report.json"


class CalibrationResult:
    """Results of `quantkit.calibrate.runner.calibrate`, backed by `work_dir/layer_NNNN.safetensors`."""

    def __init__(self, work_dir: Path, adapter: Adapter, recipe: Recipe) -> None:
        self.work_dir = work_dir
        self.adapter = adapter
        self.recipe = recipe
        self.where: dict[str, Path] = {}  # module -> layer file
        self.coverage: list[dict[str, Any]] = []  # one record per routed expert
        self.modules: list[dict[str, Any]] = []  # one record per other quantized Linear
        self.kv: dict[int, KVStats] = {}
        self.input_amax: dict[str, float] = {}  # W4A4: module -> max |input| over the calibration data

    @classmethod
    def load(cls, work_dir: Path, adapter: Adapter, recipe: Recipe) -> CalibrationResult:
        res = cls(work_dir, adapter, recipe)
        for layer in range(adapter.num_layers):
            path = work_dir / f"layer_{layer:04d}.safetensors"
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                keys = list(f.keys())
            # a layer made by several ranks lists their part files (whatever the world size reading it)
            files = [(path, keys)] + [(work_dir / name, None) for name in json.loads(meta.get("parts", "[]"))]
            for file, names in files:
                if names is None:
                    with safe_open(file, framework="pt") as f:
                        names = list(f.keys())
                for key in names:
                    if key.endswith(".weight_packed"):
                        res.where[key[: -len(".weight_packed")]] = file
            res.coverage += json.loads(meta.get("coverage", "[]"))
            res.modules += json.loads(meta.get("modules", "[]"))
            res.input_amax.update(json.loads(meta.get("amax", "null")) or {})
            kv = json.loads(meta.get("kv", "null"))
            if kv:
                res.kv[layer] = KVStats.from_json(kv)
        return res

    # ---- what the converter writes ---------------------------------------------------------------
    def quantized(self, module: str) -> PackedInt4 | None:
        """The GPTQ result for `module` (`...experts.3.gate_proj`, `.weight` suffix allowed), else None."""
        module = module[: -len(".weight")] if module.endswith(".weight") else module
        path = self.where.get(module)
        if path is None:
            return None
        with safe_open(path, framework="pt") as f:
            t = {k: f.get_tensor(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")}
        return PackedInt4(t["weight_packed"], t["weight_scale"], t["weight_shape"])

    def modules_quantized(self) -> list[str]:
        return sorted(self.where)

    @property
    def kv_scales(self) -> dict[int, tuple[float, float]] | None:
        """layer -> (k_scale, v_scale) the checkpoint ships (calibrated, or 1.0 when the recipe's `kv_scales` rule
        says unit; `quantkit.engines.kv_choice`); None without `--kv-cache fp8` and for DSA (engine-side scales)."""
        return resolve_scales(self.kv, self.adapter.kv_layout, self.recipe.kv_scales)[0]

    @property
    def kv_cache_scheme(self) -> dict[str, Any] | None:
        return dict(KV_CACHE_SCHEME) if self.kv_scales else None

    # ---- reports ---------------------------------------------------------------------------------
    def coverage_report(self) -> dict[str, Any]:
        c = self.recipe.calibration
        unreached = [(r["layer"], r["expert"]) for r in self.coverage if r["routed_tokens"] == 0]
        fallbacks = [
            {"layer": r["layer"], "expert": r["expert"], "module": p, "reason": why}
            for r in self.coverage for p, why in r["fallback"].items()
        ] + [{"module": m["module"], "reason": m["fallback"]} for m in self.modules if m["fallback"]]
        report = {
            "method": "gptq" if self.where else "none",
            "group_size": self.recipe.group_size,
            "samples": c.samples,
            "seq_len": c.seq_len,
            "dataset": c.dataset,
            "experts_all_tokens": True,
            "summary": self._error_summary(),
            "unreached_experts": [{"layer": layer, "expert": e} for layer, e in unreached],
            "fallbacks": fallbacks,
            "experts": self.coverage,
            "modules": self.modules,
        }
        if self.recipe.mixed:  # a per-unit plan: the group above is the uniform one; each unit's format here
            from quantkit.quant.precision import resolve_precision

            report["units"] = resolve_precision(self.recipe, self.adapter).units
        return report

    def _error_summary(self) -> dict[str, Any]:
        pairs = [(r["rel_error"][p], r["rtn_rel_error"][p]) for r in self.coverage for p in r["rel_error"]]
        pairs += [(m["rel_error"], m["rtn_rel_error"]) for m in self.modules]
        if not pairs:
            return {"modules": 0}
        return {
            "modules": len(pairs),
            "mean_rel_error": sum(g for g, _ in pairs) / len(pairs),
            "mean_rtn_rel_error": sum(r for _, r in pairs) / len(pairs),
            "gptq_better_than_rtn": sum(g <= r for g, r in pairs),
        }

    def write_reports(self, out_dir: Path) -> list[str]:
        """Write the coverage JSON and the KV report; return the file names.

        No legacy `kv_cache_scales.json`: SGLang's `--quantization-param-path` fails the load for every
        architecture quantkit supports (their model classes have no `load_kv_cache_scales`).
        """
        out_dir = Path(out_dir)
        written = []
        if self.coverage or self.modules:
            _dump(out_dir / COVERAGE_FILE, self.coverage_report())
            written.append(COVERAGE_FILE)
        if self.kv:
            _dump(out_dir / KV_REPORT_FILE, self.kv_report())
            written.append(KV_REPORT_FILE)
        return written

    def kv_report(self) -> dict[str, Any]:
        """The KV report, with the scales the checkpoint ships and why."""
        choice = resolve_scales(self.kv, self.adapter.kv_layout, self.recipe.kv_scales)[1]
        return kv_report(self.kv, self.adapter.kv_layout, choice)

    def summary(self) -> str:
        lines = []
        s = self._error_summary()
        if s["modules"]:
            cov = self.coverage_report()
            lines.append(
                f"GPTQ: {s['modules']} modules, mean relative output error {s['mean_rel_error']:.4f} "
                f"(RTN {s['mean_rtn_rel_error']:.4f}); better than RTN on {s['gptq_better_than_rtn']}/{s['modules']}; "
                f"{len(cov['fallbacks'])} RTN fallback(s)"
            )
            un = cov["unreached_experts"]
            if un:
                shown = ", ".join(f"L{u['layer']}/E{u['expert']}" for u in un[:8]) + (" ..." if len(un) > 8 else "")
                lines.append(f"WARNING: {len(un)} expert(s) never chosen by real routing on the calibration data "
                             f"({shown}); quantized from all-token statistics")
        if self.kv:
            lines.append(self._kv_line())
        return "\n".join(lines)

    def _kv_line(self) -> str:
        rep = kv_report(self.kv, self.adapter.kv_layout)
        if self.adapter.kv_layout == "dsa":
            return "FP8 KV (DSA): engine computes per-tile scales at write time; no checkpoint scales written"
        worst = {"sat": 0.0, "under": 0.0, "sat1": 0.0, "under1": 0.0}
        for layer in rep["layers"]:
            for key in ("kv", "k", "v"):
                if key in layer:
                    e = layer[key]
                    worst["sat"] = max(worst["sat"], e["at_calibrated_scale"]["saturated"])
                    worst["under"] = max(worst["under"], e["at_calibrated_scale"]["underflow"])
                    worst["sat1"] = max(worst["sat1"], e["at_scale_1"]["saturated"])
                    worst["under1"] = max(worst["under1"], e["at_scale_1"]["underflow"])
        return (
            f"FP8 KV ({self.adapter.kv_layout}): {len(self.kv)} layer scales; worst layer saturates "
            f"{worst['sat']:.3%} / underflows {worst['under']:.3%} at the calibrated scale "
            f"(at scale 1.0: {worst['sat1']:.3%} / {worst['under1']:.3%}); ships the "
            f"{self.kv_report()['scales']['written']} scales ({self.kv_report()['scales']['why']})"
        )


def _dump(path: Path, value: Any) -> None:
    write_json_atomic(path, value)
