"""FP8 (e4m3) KV-cache scales that match what the serving engine actually caches.

What is cached, per layer and token (formats.md §3):
- MLA (DeepSeek V3, Kimi K2.x): one row = the normalised latent (after `kv_a_layernorm`) + the rotated
  rope key; it serves as both K and V, so ONE scale per layer: `max(|latent|, |k_pe|) / 448`, k = v.
- GQA (GLM-4.x): K after rope and V, per tensor: `k_scale = max|K| / 448`, `v_scale = max|V| / 448`.
- DSA (GLM-5.x): the engine quantizes each 128-value tile with its own scale at write time; checkpoint
  scales are not used there, so none are written — the statistics are still reported.

The statistics are collected by handing the transformers attention a duck-typed cache (`StatCache`): its
`update(k, v, layer)` receives exactly the tensors the model would cache. Per layer we keep the exact
absolute maximum and a fine log2 histogram of |value|, from which the fraction of cached values that
would saturate (|x| > 448 s) or underflow to zero (|x| < s * 2^-10) in e4m3 is read for any scale s —
both at the calibrated scale and at 1.0, the scale an engine uses when the checkpoint has none.

Which of the two a checkpoint ships (`--kv-scales auto|calibrated|unit`) is `quantkit.engines.kv_choice`'s rule:
`resolve_scales` applies it (unit = every scale 1.0) and `kv_report` records the choice and why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.arch import Adapter
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = [
    "FP8_MAX",
    "KVStats",
    "resolve_scales",
    "StatCache",
    "KV_CACHE_SCHEME",
    "fp8_fractions_exact",
    "kv_report",
    "require_kv_scheme_support",
    "write_kv_scales",
]

FP8_MAX = 448.0  # float8_e4m3fn
FP8_UNDERFLOW_LOG2 = -10.0  # |x/s| below 2^-10 (half the smallest subnormal 2^-9) rounds to zero
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
_BINS_PER_OCTAVE = 32
_LO, _HI = -80.0, 48.0  # log2 range of the histogram (values outside land in the edge bins)


@dataclass
class Tally:
    """Exact max |x| plus a log2 histogram of |x| for one cached tensor stream."""

    absmax: float = 0.0
    zeros: int = 0
    total: int = 0
    hist: torch.Tensor = field(default_factory=lambda: torch.zeros(int((_HI - _LO) * _BINS_PER_OCTAVE)))

    def add(self, x: torch.Tensor) -> None:
        a = x.detach().abs().float().flatten()
        self.total += a.numel()
        if a.numel() == 0:
            return
        self.absmax = max(self.absmax, float(a.max()))
        nz = a[a > 0]
        self.zeros += a.numel() - nz.numel()
        logs = nz.log2().clamp_(_LO, _HI - 1e-6)
        self.hist += torch.histc(logs, bins=self.hist.numel(), min=_LO, max=_HI)

    def merge(self, other: Tally) -> Tally:
        return Tally(max(self.absmax, other.absmax), self.zeros + other.zeros, self.total + other.total,
                     self.hist + other.hist)

    def fraction_below(self, log2_threshold: float) -> float:
        """Fraction of non-zero values with log2|x| < threshold (linear within the boundary bin)."""
        pos = (log2_threshold - _LO) * _BINS_PER_OCTAVE
        whole = int(math.floor(min(max(pos, 0), self.hist.numel())))
        count = float(self.hist[:whole].sum())
        if whole < self.hist.numel():
            count += float(self.hist[whole]) * (pos - whole)
        return count / self.total if self.total else 0.0

    def fractions(self, scale: float) -> dict[str, float]:
        """Fractions of all cached values that saturate / underflow in e4m3 at `scale`."""
        nonzero = (self.total - self.zeros) / self.total if self.total else 0.0
        # exact when the scale covers the absmax (the calibrated case): nothing can exceed 448
        sat = 0.0
        if self.absmax > FP8_MAX * scale:
            sat = max(0.0, nonzero - self.fraction_below(math.log2(FP8_MAX * scale)))
        under = self.fraction_below(math.log2(scale) + FP8_UNDERFLOW_LOG2)
        return {"saturated": sat, "underflow": under}

    def to_json(self) -> JSONObject:
        nz = self.hist.nonzero().flatten()
        return {"absmax": self.absmax, "zeros": self.zeros, "total": self.total,
                "bins": nz.tolist(), "counts": self.hist[nz].tolist()}

    @classmethod
    def from_json(cls, d: JSONObject) -> Tally:
        t = cls(float(d["absmax"]), int(d["zeros"]), int(d["total"]))
        t.hist[torch.tensor(d["bins"], dtype=torch.long)] = torch.tensor(d["counts"], dtype=torch.float32)
        return t


def fp8_fractions_exact(x: torch.Tensor, scale: float) -> dict[str, float]:
    """Exact saturate/underflow fractions by really casting `x / scale` to e4m3 (tests, small tensors)."""
    y = x.float() / scale
    sat = (y.abs() > FP8_MAX).float().mean()
    q = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    under = ((q == 0) & (y != 0)).float().mean()
    return {"saturated": float(sat), "underflow": float(under)}


class KVStats:
    """Statistics of one layer's cache in the engine's layout (`mla`, `gqa` or `dsa`)."""

    def __init__(self, layout: str) -> None:
        self.layout = layout
        self.k = Tally()  # mla/dsa: latent + rope key (the whole cached row); gqa: K
        self.v = Tally()  # gqa only: V

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.layout == "gqa":
            self.k.add(k)
            self.v.add(v)
        else:  # MLA caches (latent, k_pe) as one row; both parts share the one scale
            self.k.add(k)
            self.k.add(v)

    def scales(self) -> tuple[float, float] | None:
        """(k_scale, v_scale) to write, or None for DSA (the engine scales tiles itself)."""
        if self.layout == "dsa":
            return None
        k = _scale(self.k.absmax)
        return (k, k) if self.layout == "mla" else (k, _scale(self.v.absmax))

    def report(self, layer: int) -> JSONObject:
        scales = self.scales()
        out: JSONObject = {"layer": layer, "layout": self.layout}
        streams = {"kv": self.k} if self.layout != "gqa" else {"k": self.k, "v": self.v}
        for i, (key, tally) in enumerate(streams.items()):
            entry: JSONObject = {"absmax": tally.absmax, "values": tally.total, "at_scale_1": tally.fractions(1.0)}
            if scales is not None:
                entry["scale"] = scales[i]
                entry["at_calibrated_scale"] = tally.fractions(scales[i])
            out[key] = entry
        return out

    def merge(self, other: KVStats) -> KVStats:
        """Statistics of both (the ranks of a distributed run each observe their own tokens)."""
        out = KVStats(self.layout)
        out.k, out.v = self.k.merge(other.k), self.v.merge(other.v)
        return out

    def to_json(self) -> JSONObject:
        return {"layout": self.layout, "k": self.k.to_json(), "v": self.v.to_json()}

    @classmethod
    def from_json(cls, d: JSONObject) -> KVStats:
        s = cls(d["layout"])
        s.k, s.v = Tally.from_json(d["k"]), Tally.from_json(d["v"])
        return s


def _scale(absmax: float) -> float:
    """absmax / 448 (1.0 when nothing non-zero was seen: the engine default, never a zero scale)."""
    return absmax / FP8_MAX if absmax > 0 else 1.0


class StatCache:
    """A stand-in for transformers' Cache that records what would be cached and caches nothing.

    MLA / GQA attention hands `update` exactly what an engine caches. transformers' DSA attention caches
    the *expanded* per-head K/V instead; there `rope_from` says where the rotated rope key starts in each
    key row, and the latent is observed separately (a hook on `kv_a_layernorm`, see the runner).
    """

    def __init__(self, stats: KVStats, rope_from: int | None = None) -> None:
        self.stats = stats
        self.rope_from = rope_from

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rope_from is None:
            self.stats.observe(key_states, value_states)
        else:  # the rope key is shared by all heads: head 0 holds it
            self.stats.k.add(key_states[:, :1, :, self.rope_from :])
        return key_states, value_states

    def update_indexer(self, k: torch.Tensor, layer_idx: int, *args: object, **kwargs: object) -> torch.Tensor:
        return k  # the DSA indexer's own small cache: not part of the FP8 KV cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


# ------------------------------------------------------------------------------------------- the choice
def worst_saturation_at_1(stats: dict[int, KVStats]) -> float:
    """The largest fraction of one layer's cached values that saturates at scale 1.0 (|x| > 448)."""
    return max((t.fractions(1.0)["saturated"] for s in stats.values() for t in (s.k, s.v) if t.total), default=0.0)


def resolve_scales(stats: dict[int, KVStats], layout: str,
                   requested: str = "auto") -> tuple[dict[int, tuple[float, float]] | None, dict[str, str]]:
    """The (k, v) scales to write per layer and the report's `scales` block: `quantkit.engines.kv_choice`'s rule
    (`requested` = auto | calibrated | unit) on this run's statistics. DSA: none (the engines scale tiles)."""
    from quantkit.arch import KVLayout
    from quantkit.engines.kv_choice import choose_scale_mode

    if not stats or layout == "dsa":
        return None, {"written": "none", "why": "DSA: the engines compute per-tile scales at write time"}
    if requested not in ("auto", "calibrated", "unit"):
        raise QuantkitError(f"--kv-scales {requested!r}: expected auto, calibrated or unit")
    mode, why = choose_scale_mode(KVLayout(layout), requested, worst_saturation_at_1(stats))  # type: ignore[arg-type]
    if mode == "unit":
        return {layer: (1.0, 1.0) for layer in sorted(stats)}, {"written": "unit", "why": why}
    return {layer: s.scales() or (1.0, 1.0) for layer, s in sorted(stats.items())}, {"written": mode, "why": why}


# ------------------------------------------------------------------------------------------- reports
def kv_report(stats: dict[int, KVStats], layout: str, scales: dict[str, str] | None = None) -> JSONObject:
    """The KV report written next to the checkpoint (per layer; worst layers first in `summary`); `scales` says
    which scales the checkpoint ships (`resolve_scales`)."""
    layers = [s.report(i) for i, s in sorted(stats.items())]
    note = {
        "mla": "one scale per layer from max(|latent after kv_a_layernorm|, |k_pe after rope|)/448; k_scale == v_scale",
        "gqa": "per-tensor K (after rope) and V scales = absmax/448",
        "dsa": "DSA engines compute per-tile FP8 scales at write time; checkpoint scales would be ignored, "
        "so none are written. Statistics below are for information.",
    }[layout]
    out: JSONObject = {"layout": layout, "fp8": "float8_e4m3fn", "fp8_max": FP8_MAX, "note": note}
    if scales is not None:
        out["scales"] = scales
    out["layers"] = layers
    return out


def scale_tensors(scales: dict[int, tuple[float, float]], adapter: Adapter) -> dict[str, torch.Tensor]:
    """The KV-scale tensors (float32 [1]) under every name an engine or transformers reads for the family.

    Names come from `quantkit.engines.verdicts.kv_scale_names` (MLA needs SGLang's `k_proj.k_scale` spelling too).
    """
    from quantkit.engines.verdicts import kv_scale_names

    out = {}
    for layer, (k, v) in sorted(scales.items()):
        for name in kv_scale_names(adapter, layer):
            out[name] = torch.tensor([k if name.endswith("k_scale") else v], dtype=torch.float32)
    return out


# ------------------------------------------------------------------- add scales to a checkpoint in place
KV_SHARD = "kv_cache_scales.safetensors"


def require_kv_scheme_support(config_path: Path, config: JSONObject) -> None:
    """Raise unless `config` is a compressed-tensors config, the only place engines read KV scales from."""
    qc = config.get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        # transformers and the engines read kv_cache_scheme only inside a compressed-tensors config with
        # weight groups; inventing one for a BF16 / FP8-block model would make it unloadable.
        method = qc.get("quant_method") if qc else "none (unquantized)"
        raise QuantkitError(
            f"{config_path}: quantization method {method} has no kv_cache_scheme, and no engine loads KV scales "
            "for this architecture another way (SGLang's --quantization-param-path fails for it); convert to INT4 "
            "with --kv-cache fp8, or run kv-scales on the INT4 output"
        )


def write_kv_scales(ckpt: Path, scales: dict[int, tuple[float, float]], adapter: Adapter) -> list[str]:
    """Add k/v scale tensors to checkpoint `ckpt` without touching its weight shards.

    Writes one small extra shard, points the index at it (creating an index for a single-file model)
    and sets `kv_cache_scheme` in the compressed-tensors `quantization_config` (other checkpoints are
    refused: none of these architectures has a loader for the legacy `--quantization-param-path` JSON in
    SGLang, so scales without a compressed-tensors config would reach no engine). Each file is replaced
    atomically; config.json goes last, so a crash leaves either the old or the new checkpoint.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    config_path = ckpt / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    require_kv_scheme_support(config_path, config)
    qc = config["quantization_config"]
    tensors = scale_tensors(scales, adapter)
    _atomic(ckpt / KV_SHARD, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    index_path = ckpt / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text(encoding="utf-8"))
    else:
        shards = sorted(p.name for p in ckpt.glob("*.safetensors") if p.name != KV_SHARD)
        if not shards:
            raise QuantkitError(f"{ckpt}: no *.safetensors weight files")
        wm = {}
        for s in shards:
            with safe_open(ckpt / s, framework="pt") as f:
                wm.update({k: s for k in f.keys()})
        index = {"metadata": {}, "weight_map": wm}
    wm = {k: v for k, v in index["weight_map"].items() if v != KV_SHARD}
    clash = [k for k in tensors if k in wm]
    if clash:
        raise QuantkitError(f"{ckpt / wm[clash[0]]}: already holds {clash[0]}; refusing to add a second copy")
    wm.update({k: KV_SHARD for k in tensors})
    index["weight_map"] = dict(sorted(wm.items()))
    write_json_atomic(index_path, index)
    qc["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    config["quantization_config"] = qc
    write_json_atomic(config_path, config)
    return [KV_SHARD, index_path.name, config_path.name]


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    from quantkit.core.paths import refuse_link, replace

    tmp = path.with_name(path.name + ".tmp")
    refuse_link(tmp, path)  # safetensors' writer follows links: check the names first (quantkit.core.paths)
    write(tmp)
    replace(tmp, path)


def link_checkpoint(src: Path, out: Path) -> None:
    """Make `out` a copy of checkpoint `src` whose weight shards are hard links (copies across devices)."""
    out.mkdir(parents=True, exist_ok=False)
    for p in src.iterdir():
        if p.is_dir():
            shutil.copytree(p, out / p.name)
        elif p.suffix == ".safetensors":
            try:
                os.link(p, out / p.name)
            except OSError:
                shutil.copy2(p, out / p.name)
        else:
            shutil.copy2(p, out / p.name)
