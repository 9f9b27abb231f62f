"""KL of a tiny trained model served with FP8 KV to its BF16-KV twin, through SGLang 0.5.23's own KV write and
attention read on the CPU; JSON out.

    python tests/engines/run_sglang_kv_kl.py OUT.json --model deepseek_v3|glm4_moe|glm_moe_dsa
        [--windows 16] [--seq 128] [--prompt 64] [--configs a,b,...] [--kernel reference|executed|check]

The model is one of quantkit's tiny trained models (`quantkit/calibrate/tiny.py`: the DeepSeek-V3-shaped MLA-MoE,
GLM-4.x GQA, GLM-5 DSA), run by transformers in fp32 on held-out windows. Attention is routed through SGLang:
MLA and GQA through a registered transformers attention function that hands each layer's query (MLA: absorbed
through `kv_b_proj`, as SGLang's decode does) and its cached rows to a `kv_kl_sessions.Session` (SGLang's pool and
backends); DSA through SGLang's own FP8 quantizer / dequantizer of the latent (`quantize_k_cache_separate`,
`dequantize_k_cache`, Triton kernels executed by the interpreter with `triton_interp_fix`) applied where
transformers caches it, transformers' own sparse attention reading the result (FlashMLA-sparse's read: the
latent dequantized to BF16, BF16 math). Per configuration: KL(twin || served) at the decode positions (>= P),
its p99 and top-1 flips, per-window means (for paired standard errors); the INT4 weights' own KL (RTN g32 of the
recipe's roles, BF16 KV) for scale; per layer, the fractions of cached values that saturate / become zero / are
subnormal at scale 1.0 and at the calibrated scale.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("TRITON_INTERPRET", "1")

import run_sglang  # noqa: E402  (tests/engines: SGLang's paths and stubs)
from kv_kl_sessions import KVConfig, Session, fp8_bands  # noqa: E402

ARCH = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
        "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
LAYOUT = {"deepseek_v3": "mla", "glm4_moe": "gqa", "glm_moe_dsa": "dsa"}
TWIN = KVConfig("bf16", "bf16", "torch_native", "unit", "plain", what="BF16 KV: the twin every KL is measured to")
CONFIGS: dict[str, tuple[KVConfig, ...]] = {
    "mla": (
        KVConfig("a", "fp8", "torch_native", "unit", "plain",
                 what="scale 1.0, plain cast, BF16 read (fa3 / flashinfer; torch_native executed)"),
        KVConfig("a_triton", "fp8", "triton", "unit", "plain", what="scale 1.0, triton read (q and P cast to FP8)"),
        KVConfig("a_flashmla", "fp8", "flashmla", "unit", "plain", what="scale 1.0, flashmla FP8 read"),
        KVConfig("b", "fp8", "triton", "calibrated", "divided",
                 what="calibrated: write / s, read x s (triton; prompt through the prefill CUDA graph)"),
        KVConfig("b_eager", "fp8", "triton", "calibrated", "plain",
                 what="calibrated, triton, prompt rows plain-cast by the eager MHA prefill"),
        KVConfig("c1", "fp8", "flashmla", "calibrated", "plain",
                 what="scaled read of an unscaled write (flashmla / trtllm_mla with the checkpoint scale)"),
        KVConfig("c2", "fp8", "torch_native", "calibrated", "divided", "divided",
                 what="rows written / s read at 1.0 (fa3 / flashinfer reading triton- or plugin-written pages)"),
        KVConfig("t16", "bf16", "triton", "unit", "plain", what="BF16 KV, triton read (the kernel's arithmetic)"),
    ),
    "gqa": (
        KVConfig("a", "fp8", "torch_native", "unit", "plain", what="scale 1.0, plain cast, BF16 read (torch_native)"),
        KVConfig("a_triton", "fp8", "triton", "unit", "plain", what="scale 1.0, triton read (q and P cast to FP8)"),
        KVConfig("b", "fp8", "triton", "calibrated", "divided", what="calibrated K and V scales, triton"),
        KVConfig("c1", "fp8", "triton", "calibrated", "plain", "plain", what="scaled read of an unscaled write"),
        KVConfig("c2", "fp8", "torch_native", "calibrated", "divided", "divided",
                 what="rows written / s read at 1.0"),
        KVConfig("t16", "bf16", "triton", "unit", "plain", what="BF16 KV, triton read"),
    ),
    "dsa": (
        KVConfig("a", "fp8", "torch_native", "unit", "plain",
                 what="scale 1.0: raw 576 B rows, latent and rope plain-cast (trtllm DSA, B200)"),
        KVConfig("b", "fp8", "torch_native", "calibrated", "plain",
                 what="per-tile scales: SGLang's 656 B rows (flashmla_kv: amax/448 per 128 values, rope BF16)"),
    ),
}


class CaptureCache:
    """transformers' DynamicCache that stores nothing: `update` hands what would be cached to `on_update`."""

    def __new__(cls, on_update: Any) -> Any:
        from transformers.cache_utils import DynamicCache

        class _Cache(DynamicCache):
            def update(self, k: Any, v: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
                return on_update(k, v, layer_idx)

            def update_indexer(self, k: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
                return k

        return _Cache()


class Harness:
    """One model, its calibrated scales and the attention route; `log_probs(model, config, tokens)`."""

    def __init__(self, name: str, tiny: Path, seq: int, prompt: int, kernel: str, context: int = 0) -> None:
        import torch
        from transformers import AttentionInterface, AutoConfig

        self.name, self.layout, self.seq, self.prompt, self.kernel = name, LAYOUT[name], seq, prompt, kernel
        self.config = AutoConfig.from_pretrained(tiny)
        self.context = context or self.config.max_position_embeddings
        self.session: Session | None = None
        self.cfg = TWIN
        self.latents: dict[int, Any] = {}  # MLA: this forward's (latent, rope) per layer; DSA: the twin's latents
        self.rows: dict[int, list[Any]] = {}  # layer -> the twin's cached rows (for the saturation bands)
        self.scales: dict[int, tuple[float, float]] = {}
        AttentionInterface.register("quantkit_sglang", self._attention)
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

    # ---- calibration (what `quantkit convert --kv-cache fp8` computes: absmax / 448 per layer) ---------------
    def calibrate(self, model: Any, tokens: Any) -> None:
        import torch

        from quantkit.calibrate.kv import KVStats

        stats = {i: KVStats(self.layout) for i in range(self.config.num_hidden_layers)}

        def observe(k: Any, v: Any, layer: int) -> Any:
            stats[layer].observe(k, v)
            return k, v

        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            for window in tokens:
                model(input_ids=window[None], past_key_values=CaptureCache(observe), use_cache=True)
        self.scales = {i: s.scales() or (1.0, 1.0) for i, s in stats.items()}

    # ---- the forward ---------------------------------------------------------------------------------------
    def log_probs(self, model: Any, cfg: KVConfig, tokens: Any) -> Any:
        import torch

        self.cfg = cfg
        outs = []
        hooks = self._dsa_hooks(model) if self.layout == "dsa" else []
        model.set_attn_implementation("sdpa" if self.layout == "dsa" else "quantkit_sglang")
        c = self.config
        if self.layout != "dsa":
            mla = self.layout == "mla"
            self.session = Session(cfg, mla, c.num_hidden_layers, c.num_attention_heads,
                                   1 if mla else c.num_key_value_heads, getattr(c, "head_dim", 0) or 0,
                                   getattr(c, "head_dim", 0) or 0, self.seq, self.scales,
                                   self.context, self.kernel)  # type: ignore[arg-type]
        try:
            with torch.no_grad():
                for window in tokens:
                    logits = model(input_ids=window[None], past_key_values=CaptureCache(self._on_update),
                                   use_cache=True).logits[0, self.prompt:].float()
                    outs.append(torch.log_softmax(logits, dim=-1))
        finally:
            for h in hooks:
                h.remove()
        return torch.stack(outs)

    def _on_update(self, k: Any, v: Any, layer: int) -> Any:
        import kv_kl_attend

        if self.layout == "mla":
            self.latents[layer] = (k, v)
        elif self.layout == "dsa":
            k = k.clone()
            nope = self.config.qk_nope_head_dim
            k[..., nope:] = kv_kl_attend.dsa_rope(k[..., nope:], self.cfg.name)
        if self.cfg.name == "bf16" and self.layout != "mla":
            self.rows.setdefault(layer, []).append((k, v))
        return k, v

    def _dsa_hooks(self, model: Any) -> list[Any]:
        """DSA: the latent (kv_a_layernorm's output, what SGLang caches) as the configuration stores and reads it."""
        import kv_kl_attend

        def hook(module: Any, _args: Any, out: Any, layer: int) -> Any:
            if self.cfg.name == "bf16":
                self.latents.setdefault(layer, []).append(out.detach().reshape(-1, out.shape[-1]))
            return kv_kl_attend.dsa_round_trip(out, self.cfg.name)

        return [layer.self_attn.kv_a_layernorm.register_forward_hook(
            lambda m, a, out, i=i: hook(m, a, out, i)) for i, layer in enumerate(model.model.layers)]

    def _attention(self, module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: Any = None,
                   dropout: float = 0.0, **kwargs: Any) -> tuple[Any, None]:
        import kv_kl_attend as attend

        assert self.session is not None
        if self.layout == "mla":
            kv_nope, k_rot = self.latents[module.layer_idx]
            out, rows = attend.mla(self.session, module, query, kv_nope, k_rot, self.prompt)
            if self.cfg.name == "bf16":
                self.rows.setdefault(module.layer_idx, []).append(rows)
        else:
            out = attend.gqa(self.session, module, query, key, value, self.prompt)
        return out, None

    # ---- saturation bands of the twin's rows ----------------------------------------------------------------
    def bands(self) -> list[dict[str, Any]]:
        import torch

        out = []
        for layer, chunks in sorted(self.rows.items()):
            k_s, v_s = self.scales.get(layer, (1.0, 1.0))
            if self.layout == "mla":
                rows = torch.cat(chunks)
                lora = self.config.kv_lora_rank
                parts = {"nope": (rows[:, :lora], k_s), "rope": (rows[:, lora:], k_s)}
            elif self.layout == "gqa":
                parts = {"k": (torch.cat([k for k, _ in chunks], dim=2), k_s),
                         "v": (torch.cat([v for _, v in chunks], dim=2), v_s)}
            else:  # DSA: per-tile scales (amax / 448 of each 128 values) leave no value saturating
                nope = self.config.qk_nope_head_dim
                parts = {"nope": (torch.cat(self.latents[layer]), 1.0),
                         "rope": (torch.cat([k[:, :1, :, nope:] for k, _ in chunks], dim=2), 1.0)}
            entry: dict[str, Any] = {"layer": layer}
            for part, (x, s) in parts.items():
                entry[part] = {"scale": s, "at_1": fp8_bands(x, 1.0), "at_calibrated": fp8_bands(x, s)}
            out.append(entry)
        return out


def kl_stats(ref: Any, lp: Any) -> dict[str, Any]:
    """KL(ref || lp) per position, over [windows, positions, vocab] log-probs."""
    import torch

    kl = (ref.exp() * (ref - lp)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl.flatten(), 0.99)),
            "top1_flip": float((ref.argmax(-1) != lp.argmax(-1)).float().mean()),
            "window_kl": [float(x) for x in kl.mean(-1)]}


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens
    from quantkit.calibrate.eval import fake_quantized_copy, heldout_tokens
    from quantkit.calibrate.tiny import CORPUS, HELDOUT, build_tiny
    from quantkit.quant.recipe import load_recipe

    tiny = build_tiny(a.model, log=lambda *x: None)
    if LAYOUT[a.model] != "dsa":
        run_sglang._publish(tiny, ["--attention-backend", "triton", "--kv-cache-dtype", "fp8_e4m3",
                                   "--page-size", "1"])
    h = Harness(a.model, tiny, a.seq, a.prompt, a.kernel, a.context)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny))
    h.calibrate(model, calibration_tokens(CORPUS, tok, samples=a.calib, seq_len=a.seq, seed=1))
    tokens = heldout_tokens(HELDOUT, tiny, a.seq, a.windows)
    twin = h.log_probs(model, TWIN, tokens)
    wanted = a.configs.split(",") if a.configs else [c.name for c in CONFIGS[h.layout]]
    report: dict[str, Any] = {"model": a.model, "layout": h.layout, "windows": int(tokens.shape[0]), "seq": a.seq,
                              "prompt": a.prompt, "kernel": a.kernel, "tiny": tiny.name,
                              "scales": {str(i): s for i, s in h.scales.items()}, "configs": {},
                              "layers": h.bands()}
    for cfg in CONFIGS[h.layout]:
        if cfg.name not in wanted:
            continue
        entry = {"what": cfg.what, **kl_stats(twin, h.log_probs(model, cfg, tokens))}
        if h.session is not None and a.kernel == "check":
            entry["max_kernel_diff"] = h.session.max_diff
        report["configs"][cfg.name] = entry
    if not a.no_int4:
        roles = {r.value for r in load_recipe(None, json.loads((tiny / "config.json").read_text())).quantize_roles}
        with tempfile.TemporaryDirectory(prefix="kv-kl-int4-") as tmp:
            fake_quantized_copy(tiny, Path(tmp), lambda _m: None, 32, roles)
            int4 = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        report["int4"] = {"what": f"INT4 RTN g32 weights ({', '.join(sorted(roles))}), BF16 KV",
                          **kl_stats(twin, h.log_probs(int4, TWIN, tokens))}
    return report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=sorted(ARCH), required=True)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--calib", type=int, default=16, help="calibration windows (of --seq tokens)")
    ap.add_argument("--configs", default="")
    ap.add_argument("--kernel", choices=["reference", "executed", "check"], default="reference")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--context", type=int, default=0,
                    help="the context length served (SGLang's MLA split cap); default the model's")
    a = ap.parse_args(argv)
    run_sglang.prepare([ARCH[a.model]], preload=True)
    from stubs import install_sglang_attention_stubs

    install_sglang_attention_stubs()
    import run_sglang_attn
    import sglang.srt.mem_cache.memory_pool as pool_module

    for attr, factory in run_sglang_attn.POOL_PATCH.items():  # the pool's Triton row copy, as a torch copy
        setattr(pool_module, attr, factory([], attr))
    import triton_interp_fix

    triton_interp_fix.install()
    report = run(a)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
