"""The SGLang prefill/decode (PD) pair as data: two server launches and a router that SGLang 0.5.23 accepts.

SGLang's decode server checks the prefill's bootstrap reply on the first request
(`disaggregation/common/conn.py: CommonKVManager.try_ensure_parallel_info`): page sizes must be equal and the
two `kv_cache_dtype` *strings* must be equal. The string is `model_runner.kv_cache_dtype_str`: the dtype
`configure_kv_cache_dtype` resolved (`auto` + a static FP8 `kv_cache_scheme` -> `fp8_e4m3`), else the CLI
string as typed (`auto` stays `auto`, `bf16` stays `bf16`). A refused pair kills the decode scheduler.
Checks SGLang does not make but a pair must pass, or pages are copied raw into a pool of another shape or
meaning: the same `--dtype` under `auto` KV, the same DSA row layout (656 B with per-tile scales vs the raw
576 B, chosen per side from its DSA backend: `kv_cache_configurator.py: calculate_mla_kv_cache_dim`), and the
same KV scale on both sides (the decode reads the prefill's pages with its own scale).

The default pair runs with stock SGLang: both sides `--kv-cache-dtype fp8_e4m3`, the prefill on the FP8
source, the decode on quantkit's INT4 output, with attention backends that agree on the bytes and the scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from quantkit.arch import KVLayout
from quantkit.core.jsontypes import JSONObject
from quantkit.engines.kv_backends import GpuArch, sglang_backend, sglang_effective_scale
from quantkit.engines.verdicts import CheckpointFacts, engine_verdicts

__all__ = ["PDPair", "PDRouter", "PDSide", "gpu_arch", "pd_pair", "pd_problems", "pd_split", "resolve_kv_dtype_str"]

Mode = Literal["prefill", "decode"]
KVRow = Literal["mla", "dsa-656", "dsa-576", "gqa"]
BOOTSTRAP_PORT = 8998
# The PD KV plugin's switches (quantkit.serving.pd.sglang reads them): on the prefill, ENV=MODE turns it on and
# DECODE_ENV names the decode's checkpoint (its split record and KV scales).
ENV = "QUANTKIT_PD_KV"
DECODE_ENV = "QUANTKIT_PD_KV_DECODE"
MODE = "bf16-to-fp8"
PORTS: dict[Mode, int] = {"prefill": 30000, "decode": 30001}
_PER_TILE_BLOCK = 128  # DSATokenToKVPool.quant_block_size: one fp32 scale per 128 FP8 values


def resolve_kv_dtype_str(cli: str, fp8_kv_cache_scheme: bool) -> str:
    """The `kv_cache_dtype` string a side advertises (SGLang `configure_kv_cache_dtype` + model_runner): `auto`
    with a static FP8 kv_cache_scheme resolves to `fp8_e4m3`; every other value stays the CLI string."""
    return "fp8_e4m3" if cli == "auto" and fp8_kv_cache_scheme else cli


def gpu_arch(gpu_key: str) -> GpuArch:
    """The SM family SGLang's defaults branch on for a GPU catalog key."""
    return {"h100": "sm90", "h200": "sm90", "h20": "sm90", "b200": "sm100", "b300": "sm100",
            "gb200": "sm100"}.get(gpu_key, "other")


@dataclass(frozen=True)
class PDSide:
    """One server of the pair: its argv and what it will advertise and store."""

    mode: Mode
    checkpoint: str  # what --model-path loads
    weights: str  # fp8 (the source) | int4-gN (quantkit's output) | bf16
    args: list[str]  # the full launch argv
    kv_cache_dtype: str  # --kv-cache-dtype as passed
    kv_dtype_resolved: str  # the string SGLang compares across the pair
    kv_scale: str  # the KV scale this side's attention really applies (write and read): "1.0", "calibrated", ...
    page_size: int
    dtype: str  # --dtype
    attention_backend: str  # --attention-backend (DSA: the DSA sub-backend of this side's role)
    kv_row: KVRow
    kv_row_bytes: int  # bytes of one token's KV row in one layer
    port: int
    env: dict[str, str] = field(default_factory=dict)  # environment the server needs (the PD KV plugin)
    # What goes on the wire when it differs from what this side stores (the prefill of the plugin split): the
    # dtype string it advertises and the row its pages are converted to. "" = as stored.
    wire_kv_dtype: str = ""
    wire_row: str = ""
    wire_row_bytes: int = 0

    @property
    def advertised(self) -> str:
        return self.wire_kv_dtype or self.kv_dtype_resolved

    @property
    def sent_row(self) -> tuple[str, int]:
        return (self.wire_row, self.wire_row_bytes) if self.wire_row else (self.kv_row, self.kv_row_bytes)


@dataclass(frozen=True)
class PDRouter:
    args: list[str]


@dataclass(frozen=True)
class PDPair:
    prefill: PDSide
    decode: PDSide
    router: PDRouter
    gives_up: str  # what the prefill gives up against the production split (BF16 KV on prefill)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> JSONObject:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: JSONObject) -> PDPair:
        return cls(PDSide(**data["prefill"]), PDSide(**data["decode"]), PDRouter(**data["router"]),
                   str(data.get("gives_up", "")), list(data.get("notes", [])))


def _kv_row(facts: CheckpointFacts, kv_fp8: bool, dsa_backend: str | None) -> tuple[KVRow, int]:
    c = facts.adapter.config
    layout = facts.adapter.kv_layout
    if layout == KVLayout.GQA:
        heads, head_dim = int(c.get("num_key_value_heads") or c["num_attention_heads"]), int(
            c.get("head_dim") or int(c["hidden_size"]) // int(c["num_attention_heads"]))
        return "gqa", 2 * heads * head_dim * (1 if kv_fp8 else 2)
    latent, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
    if layout == KVLayout.DSA and kv_fp8:
        if dsa_backend in ("trtllm", "tilelang"):
            return "dsa-576", latent + rope
        return "dsa-656", latent + latent // _PER_TILE_BLOCK * 4 + rope * 2  # FP8 latent, fp32 tile scales, bf16 rope
    return ("dsa-576" if layout == KVLayout.DSA else "mla"), (latent + rope) * (1 if kv_fp8 else 2)


def _side(mode: Mode, facts: CheckpointFacts, checkpoint: str, weights: str, scales_loaded: bool, arch: GpuArch,
          tp: int, page_size: int, extra: list[str], backend: str) -> PDSide:
    layout = facts.adapter.kv_layout
    backend_args = (["--dsa-prefill-backend", backend, "--dsa-decode-backend", backend] if layout == KVLayout.DSA
                    else ["--attention-backend", backend])
    kv_row, row_bytes = _kv_row(facts, True, backend if layout == KVLayout.DSA else None)
    args = ["python", "-m", "sglang.launch_server", "--model-path", checkpoint, "--tp-size", str(tp),
            "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT),
            "--kv-cache-dtype", "fp8_e4m3", "--page-size", str(page_size), "--dtype", "bfloat16",
            *backend_args, "--port", str(PORTS[mode]), "--trust-remote-code", *extra]
    return PDSide(mode, checkpoint, weights, args, "fp8_e4m3", resolve_kv_dtype_str("fp8_e4m3", False),
                  sglang_effective_scale(layout, backend, scales_loaded), page_size, "bfloat16", backend, kv_row,
                  row_bytes, PORTS[mode])


def pd_pair(facts: CheckpointFacts, *, source: str = "<fp8-source>", output: str = "<MODEL>", tp: int = 8,
            arch: GpuArch = "sm90", page_size: int = 64, prefill_extra: list[str] | None = None,
            decode_extra: list[str] | None = None, weights: str = "int4", prefill_weights: str = "fp8") -> PDPair:
    """The default pair for a quantkit checkpoint (`facts`): prefill on the FP8 source, decode on the output,
    both with FP8 KV at the same scale and byte layout. `*_extra` are deployment args (memory, EP, ...)."""
    sglang = engine_verdicts(facts, ("sglang",))["sglang"]
    int4_args = _side_args(sglang.args)
    calibrated = sglang.kv_cache.scale == "calibrated"
    layout = facts.adapter.kv_layout
    same = prefill_weights == weights  # both sides load quantkit's output (e.g. Kimi: only INT4 fits)
    backend = _pair_backend(layout, arch, calibrated, same)
    prefill = _side("prefill", facts, output if same else source, prefill_weights, calibrated and same, arch, tp,
                    page_size, (int4_args if same else []) + list(prefill_extra or []), backend)
    decode = _side("decode", facts, output, weights, calibrated, arch, tp, page_size,
                   int4_args + list(decode_extra or []), backend)
    router = PDRouter(["python", "-m", "sglang_router.launch_router", "--pd-disaggregation",
                       "--prefill", f"http://<prefill-host>:{PORTS['prefill']}", str(BOOTSTRAP_PORT),
                       "--decode", f"http://<decode-host>:{PORTS['decode']}", "--host", "0.0.0.0", "--port", "8000"])
    sat = facts.kv_saturation_at_1
    at_one = f" (the KV report measures {sat:.4%} of values saturating at scale 1.0)" if sat is not None else ""
    scale = {"per-tile": "its per-tile scales", "calibrated": "the calibrated scale"}.get(
        prefill.kv_scale, f"scale {prefill.kv_scale}")
    gives_up = (f"the prefill writes FP8 KV at {scale} instead of BF16: every prompt token's latent is rounded to "
                f"FP8 once{at_one}; the production split (BF16 on prefill, FP8 on decode) needs a KV hand-off that "
                "converts dtypes, which stock SGLang does not have (quantkit's SGLang plugin does: "
                "`quantkit plan --pd --split`)")
    notes = _pair_notes(layout, arch, calibrated, same, decode.attention_backend)
    return PDPair(prefill, decode, router, gives_up, notes)


def _side_args(args: list[str]) -> list[str]:
    """A side's checkpoint args without the KV flags the pair sets itself."""
    for flag in ("--kv-cache-dtype", "--attention-backend", "--page-size"):
        args = _without_flag(args, flag)
    return args


def _pair_backend(layout: KVLayout, arch: GpuArch, calibrated: bool, same: bool) -> str:
    """The attention backend both sides pin (quantkit/engines/kv_choice.py): for MLA, the fastest backend
    consistent at scale 1.0 -- unless the decode checkpoint ships calibrated scales: then triton when both sides
    load them, else a backend that ignores them (the FP8 source's pages are a plain cast); for DSA, flashmla_kv
    (per-tile rows) on every GPU."""
    from quantkit.engines.kv_choice import DSA_BACKEND, UNIT_BACKEND

    if layout == KVLayout.DSA:  # per-tile 656 B rows on every GPU: raw 576 B rows measured above the threshold
        return DSA_BACKEND
    if layout != KVLayout.MLA:
        return sglang_backend(layout, arch)
    if calibrated:
        return "triton" if same else sglang_backend(layout, arch)
    return UNIT_BACKEND[arch]


def _pair_notes(layout: KVLayout, arch: GpuArch, calibrated: bool, same: bool, backend: str) -> list[str]:
    if layout != KVLayout.MLA or not calibrated:
        return []
    if same:
        return ["both sides apply the calibrated scales (triton); the prefill writes prompt rows divided by "
                "k_scale only inside its prefill CUDA graph, eager prefills write a plain cast the decode reads "
                "x k_scale (docs/serving.md); --kv-scales unit avoids it"]
    return [f"the decode's calibrated KV scales are not applied: the prefill's FP8 source has none, so both sides "
            f"run scale 1.0 ({backend} ignores the checkpoint scale, and converts the whole FP8 pool to BF16 on "
            "every layer: sglang#35291); a checkpoint converted with --kv-scales unit pins the fastest backend "
            "instead (docs/serving.md)"]


def _without_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        out.append(a)
    return out


def pd_problems(pair: PDPair) -> list[str]:
    """Why SGLang would refuse the pair or silently corrupt its pages, each naming the flag to change."""
    p, d = pair.prefill, pair.decode
    problems = []
    if p.page_size != d.page_size:
        problems.append(f"--page-size differs (prefill {p.page_size}, decode {d.page_size}): SGLang's decode "
                        "refuses the pair on the first request (Page size mismatch)")
    if p.advertised != d.kv_dtype_resolved:
        problems.append(f"--kv-cache-dtype resolves to {p.advertised!r} on the prefill and "
                        f"{d.kv_dtype_resolved!r} on the decode: SGLang compares the strings and refuses the pair "
                        "on the first request (KV cache dtype mismatch); set --kv-cache-dtype fp8_e4m3 on both sides")
    if p.dtype != d.dtype and "auto" in (p.advertised, d.kv_dtype_resolved):
        problems.append(f"--dtype differs ({p.dtype} vs {d.dtype}) under --kv-cache-dtype auto: both advertise "
                        "'auto', SGLang accepts, and pages of one dtype are read as the other")
    (row, row_bytes) = p.sent_row
    if row != d.kv_row or row_bytes != d.kv_row_bytes:
        problems.append(f"KV rows differ ({row} {row_bytes} B sent by the prefill, {d.kv_row} {d.kv_row_bytes} "
                        "B on the decode): pages are copied with the prefill's size into the decode's layout; set "
                        "the same --dsa-prefill-backend/--dsa-decode-backend (or --attention-backend) on both sides")
    if p.wire_row:
        problems += _split_problems(p, d)
    elif p.kv_scale != d.kv_scale:
        problems.append(f"KV scales differ (prefill {p.kv_scale}, decode {d.kv_scale}): the decode reads the "
                        "prefill's FP8 pages with its own scale; change the decode's --attention-backend to one "
                        "that applies the same scale")
    return problems


def _split_problems(p: PDSide, d: PDSide) -> list[str]:
    """The plugin split: the prefill must carry the plugin's environment, pointed at the decode's checkpoint."""
    problems = []
    if p.env.get(ENV) != MODE:
        problems.append(f"the prefill converts pages only with {ENV}={MODE} in its environment")
    if p.env.get(DECODE_ENV) != d.checkpoint:
        problems.append(f"{DECODE_ENV} must name the decode's checkpoint ({d.checkpoint}), it names "
                        f"{p.env.get(DECODE_ENV)!r}: the prefill would quantize with another checkpoint's KV scales")
    if p.kv_dtype_resolved not in ("auto", "bf16", "bfloat16"):
        problems.append(f"the plugin's prefill must store BF16 KV, it resolves {p.kv_dtype_resolved!r}: run it with "
                        "--kv-cache-dtype bf16 (or auto on a checkpoint without a kv_cache_scheme)")
    return problems


def pd_split(facts: CheckpointFacts, *, source: str = "<fp8-source>", output: str = "<MODEL>", tp: int = 8,
             arch: GpuArch = "sm90", page_size: int = 64, prefill_extra: list[str] | None = None,
             decode_extra: list[str] | None = None, weights: str = "int4", prefill_weights: str = "fp8") -> PDPair:
    """The production split through quantkit's SGLang plugin (`quantkit.serving.pd.sglang`): the prefill on the
    FP8 source keeps BF16 KV (`--kv-cache-dtype auto`) and converts each page in transit into the decode's FP8
    rows at the decode's scale; the decode (quantkit's output) is a stock SGLang server. MLA decodes with
    calibrated scales pin the backend that applies them (triton); DSA decodes pin flashmla_kv (656 B rows with
    per-tile scales: the row the plugin writes)."""
    plain = pd_pair(facts, source=source, output=output, tp=tp, arch=arch, page_size=page_size,
                    prefill_extra=prefill_extra, decode_extra=decode_extra, weights=weights,
                    prefill_weights=prefill_weights)
    sglang = engine_verdicts(facts, ("sglang",))["sglang"]
    layout = facts.adapter.kv_layout
    if layout == KVLayout.GQA:
        raise ValueError("the PD KV plugin converts MLA/DSA pages only")
    calibrated = sglang.kv_cache.scale == "calibrated"
    backend = "flashmla_kv" if layout == KVLayout.DSA else (
        sglang.kv_cache.attention_backend if calibrated else plain.decode.attention_backend)
    int4_args = _side_args(sglang.args)
    decode = _side("decode", facts, output, weights, calibrated, arch, tp, page_size,
                   int4_args + list(decode_extra or []), backend)
    bf16_row, bf16_bytes = _kv_row(facts, False, None)
    # On quantkit's output (one checkpoint for both sides) `auto` would resolve to its FP8 kv_cache_scheme: ask
    # for bf16 by name there; on the FP8 source (no KV scheme) `auto` is the model dtype.
    same = prefill_weights == weights
    checkpoint, kv = (output, "bf16") if same else (source, "auto")
    args = ["python", "-m", "sglang.launch_server", "--model-path", checkpoint, "--tp-size", str(tp),
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT),
            "--disaggregation-transfer-backend", "mooncake", "--kv-cache-dtype", kv, "--page-size",
            str(page_size), "--dtype", "bfloat16", "--port", str(PORTS["prefill"]), "--trust-remote-code",
            *((int4_args if same else []) + list(prefill_extra or []))]
    env = {ENV: MODE, DECODE_ENV: output}
    prefill = PDSide("prefill", checkpoint, prefill_weights, args, kv, kv, "BF16 (no scale)", page_size,
                     "bfloat16", "sglang default (BF16 KV)", bf16_row, bf16_bytes, PORTS["prefill"], env,
                     decode.kv_dtype_resolved, decode.kv_row, decode.kv_row_bytes)
    gives_up = ("nothing on the KV: the prefill attends over BF16 KV; each page is rounded to the decode's FP8 "
                f"once, in transit ({decode.kv_row}, {decode.kv_row_bytes} B per token and layer), exactly as the "
                "decode would have written it; costs a staging area on the prefill (8192 tokens x layers x row "
                "bytes by default) and one conversion per page sent")
    notes = [f"prefill environment: {ENV}={MODE} {DECODE_ENV}=<the decode's checkpoint directory> (quantkit "
             "installed in the prefill's Python; the decode runs stock SGLang)"]
    if layout == KVLayout.DSA and arch == "sm100":
        notes.append("DSA on Blackwell: the decode pins flashmla_kv (656 B rows) instead of SGLang's trtllm default "
                     "(576 B raw rows, which the plugin does not write)")
    return PDPair(prefill, decode, plain.router, gives_up, notes)
