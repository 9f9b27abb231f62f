"""Cases, pools and page checks of run_sglang_pd_transfer.py (imported in its SGLang process, after prepare()).

Pools: MLA (DeepSeek-V3) `MLATokenToKVPool` as before; DSA (GLM-5) SGLang's `DSATokenToKVPool`, built by
`KVCacheConfigurator._build_dsa_kv_pool` itself (run on an object carrying only the attributes it reads, as
ModelRunner's configurator would: `kv_cache_dim` from `calculate_mla_kv_cache_dim`, the indexer K cache, its
page geometry). SGLang's DSA pool only accepts GLM-5's indexer head of 128 (`assert index_head_dim == 128`); the
pool is built with 128 (`INDEX_HEAD_DIM`), which the synthetic GLM-5 checkpoint with the real MLA dims carries
too (index_head_dim twice qk_rope_head_dim, as GLM-5.x releases).

DSA reference: after the transfer the decode child writes the prefill's latents (the BF16 pages it sent) into a
second FP8 DSA pool of its own, at the destination tokens, by the pool's `set_mla_kv_buffer` (the DSA write path:
`quantize_k_cache_separate`, then the row copy; only the Triton row-copy kernel is run_sglang_attn's torch
stand-in, the interpreter cannot run it). The transferred pool must equal that pool byte for byte, everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

PAGES = (1, 64)
POOL_PAGES = 8  # usable pages per pool (page 0 of the buffer is SGLang's padding page)
SRC_PAGES = (1, 3, 4)  # what the prefill sends
CANARY = 0xA5  # every decode byte before the transfer
INDEX_HEAD_DIM = 128  # GLM-5's indexer head (the only one DSATokenToKVPool accepts)
PLUGIN_ENV = {"QUANTKIT_PD_KV": "bf16-to-fp8", "QUANTKIT_PD_KV_DECODE": "{ckpt}"}
# the decode's DSA kernels as quantkit's pd_split record launches it (656 B FP8 rows)
DSA_DECODE_ARGS = ["--dsa-prefill-backend", "flashmla_kv", "--dsa-decode-backend", "flashmla_kv"]
# case -> prefill / decode --kv-cache-dtype, prefill env, decode destination pages, and (control only) the
# dtype string the decode manager claims, so that SGLang's dtype check passes and the raw copy runs.
CASES: dict[str, dict[str, Any]] = {
    "fp8": {"prefill": "fp8_e4m3", "decode": "fp8_e4m3", "env": {}, "dst": (5, 2, 6)},
    # the prefill's sender would wait for the decode until SGLang's bootstrap timeout: shortened to see its end
    "bf16-fp8": {"prefill": "bf16", "decode": "fp8_e4m3", "env": {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1"},
                 "dst": (5, 2, 6)},
    # dst pages in the first half: the BF16 item length doubles every decode offset (more would write past the pool)
    "bf16-fp8-forced": {"prefill": "bf16", "decode": "fp8_e4m3", "env": {}, "dst": (1, 2, 3), "claim": "bf16"},
    "plugin": {"prefill": "auto", "decode": "fp8_e4m3", "dst": (5, 2, 6), "prefill_ckpt": "source",
               "env": PLUGIN_ENV},
    # a staging of one page per layer: the request's 3 pages go out in 3 rounds of SGLang's send
    "plugin-rounds": {"prefill": "auto", "decode": "fp8_e4m3", "dst": (5, 2, 6), "prefill_ckpt": "source",
                      "env": {**PLUGIN_ENV, "QUANTKIT_PD_KV_STAGING_TOKENS": "{page}"}},
    # GLM-5: BF16 DSA prefill pool -> FP8 DSA decode pool (656 B rows); the indexer K cache moves as SGLang's state
    "plugin-dsa": {"prefill": "auto", "decode": "fp8_e4m3", "dst": (5, 2, 6), "prefill_ckpt": "source",
                   "env": PLUGIN_ENV, "model": "dsa", "decode_args": DSA_DECODE_ARGS},
}
DEFAULT_CASES = ("fp8", "bf16-fp8", "bf16-fp8-forced", "plugin", "plugin-rounds")


def checkpoints(case: str, ckpts: dict[str, str]) -> tuple[str, str | None]:
    """(decode checkpoint, prefill source or None) of a case."""
    if CASES[case].get("model") == "dsa":
        return ckpts["dsa"], ckpts.get("dsa_source")
    return ckpts["ckpt"], ckpts.get("source")


def build_pool(model_config: Any, dtype: Any, page: int) -> tuple[Any, dict[str, Any]]:
    """(the server's KV pool on the CPU, notes): MLA as before, DSA by SGLang's own configurator method."""
    from sglang.srt.configs.model_config import is_deepseek_dsa
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    hf = model_config.hf_text_config
    if not is_deepseek_dsa(model_config.hf_config):
        return MLATokenToKVPool(size=POOL_PAGES * page, page_size=page, dtype=dtype, kv_lora_rank=hf.kv_lora_rank,
                                qk_rope_head_dim=hf.qk_rope_head_dim, layer_num=model_config.num_hidden_layers,
                                device="cpu", enable_memory_saver=False), {"pool": "MLATokenToKVPool"}
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    notes = {"pool": "DSATokenToKVPool", "index_head_dim_checkpoint": model_config.hf_config.index_head_dim}
    for config in {id(c): c for c in (model_config.hf_config, hf)}.values():
        config.index_head_dim = INDEX_HEAD_DIM
    layers = model_config.num_hidden_layers
    runner = SimpleNamespace(kv_shard_rank=None, is_draft_worker=False, use_mla_backend=True,
                             model_config=model_config, loc_space_scale=1, pool_page_size=page, kv_cache_dtype=dtype,
                             layer_info=SimpleNamespace(start_layer=0, end_layer=layers, num_effective_layers=layers),
                             device="cpu")
    pool = KVCacheConfigurator._build_dsa_kv_pool(runner, max_total_num_tokens=POOL_PAGES * page,
                                                  max_running_requests=4, dsa_pool_class=DSATokenToKVPool)
    assert type(pool) is DSATokenToKVPool, type(pool)
    return pool, notes


def pool_error(model_config: Any, dtype: Any, page: int) -> str | None:
    """Why this server's pool cannot be built at `page` (None if it can)."""
    try:
        build_pool(model_config, dtype, page)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def state_buffers(pool: Any) -> list[Any]:
    """The DSA indexer K cache (SGLang's StateType.DSA component), per layer; [] for MLA."""
    return list(getattr(pool, "index_k_with_scale_buffer", None) or [])


def state_indices(kv_args: Any, pages: Any) -> list[Any] | None:
    """Per state component SGLang registered: the request's pages for DSA (its `_dsa_pages_payload`)."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import StateType

    types = list(getattr(kv_args, "state_types", []) or [])
    if not types:
        return None
    return [np.array(pages, dtype=np.int32) if st == StateType.DSA else None for st in types]


def fill(pool: Any, fp8: bool) -> None:
    import torch

    gen = torch.Generator().manual_seed(7)
    for buf in pool.kv_buffer:
        if fp8:  # arbitrary FP8 bytes
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        else:  # latents of a realistic size
            buf.copy_((torch.randn(buf.shape, generator=gen) * 3).to(buf.dtype))
    for buf in state_buffers(pool):  # indexer keys + scales: arbitrary bytes
        buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))


def canary(pool: Any) -> None:
    import torch

    for buf in [*pool.kv_buffer, *state_buffers(pool)]:
        buf.view(torch.uint8).fill_(CANARY)


def dump(pool: Any, path: Path) -> None:
    import torch

    torch.save({"kv": [b.clone() for b in pool.kv_buffer], "state": [b.clone() for b in state_buffers(pool)]}, path)


def dsa_reference(pool: Any, src_kv: list[Any], page: int, dst_pages: tuple[int, ...]) -> list[Any]:
    """The decode pool's own write of the prefill's latents at the destination tokens (a fresh canary pool of the
    same build): `set_mla_kv_buffer`, the DSA FP8 write path."""
    import run_sglang_attn as attn
    import torch
    from sglang.srt.mem_cache import memory_pool
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    for name, factory in attn.POOL_PATCH.items():  # the Triton row copy, in torch
        setattr(memory_pool, name, factory([], name))
    canary(pool)
    rank = pool.kv_lora_rank
    locs = (torch.tensor(dst_pages)[:, None] * page + torch.arange(page)).reshape(-1)
    batch = attn.Anything(out_cache_loc=locs, out_cache_loc_is_physical=False)
    for layer, src in enumerate(src_kv):
        rows = src.reshape(-1, page, src.shape[-1])[torch.tensor(SRC_PAGES)].reshape(-1, 1, src.shape[-1])
        pool.set_mla_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc.for_batch(batch),
                               rows[..., :rank].contiguous(), rows[..., rank:].contiguous())
    return [b.clone() for b in pool.kv_buffer]


def _k_scales(ckpt: str, layers: int) -> list[float]:
    from safetensors import safe_open

    index = json.loads((Path(ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    scales = []
    for i in range(layers):
        name = f"model.layers.{i}.self_attn.k_proj.k_scale"
        with safe_open(Path(ckpt) / index[name], "pt") as f:
            scales.append(float(f.get_tensor(name)))
    return scales


def _pages(buf: Any, page: int) -> Any:
    import torch

    return buf.view(torch.uint8).reshape(-1, page, buf.shape[-1] * buf.element_size())


def _check(dst_pages: Any, want: Any, dst: tuple[int, ...], out: dict[str, Any]) -> None:
    """Add one layer's destination pages (against `want`) and every other page (still the canary) to `out`."""
    import torch

    got = dst_pages[torch.tensor(dst)]
    out["differing_bytes"] += int((got != want).sum()) if got.shape == want.shape else int(got.numel())
    out["intended_pages_still_canary"] += int((got == CANARY).all(dim=(1, 2)).sum())
    others = torch.ones(dst_pages.shape[0], dtype=torch.bool)
    others[list(dst)] = False
    out["stray_bytes"] += int((dst_pages[others] != CANARY).sum())


def compare(case: str, ckpt: str, page: int, work: Path) -> dict[str, Any]:
    """Destination pages against what the decode should hold; every other decode byte still the canary."""
    import torch

    from quantkit.serving.pd.sglang import mla_pages_to_fp8

    src_all, dst_all = torch.load(work / "prefill.pt"), torch.load(work / "decode.pt")
    src, dst, dst_pages = src_all["kv"], dst_all["kv"], CASES[case]["dst"]
    reference = torch.load(work / "reference.pt") if (work / "reference.pt").exists() else None
    plugin = bool(CASES[case]["env"].get("QUANTKIT_PD_KV"))
    scales = _k_scales(ckpt, len(src)) if plugin and reference is None else [1.0] * len(src)
    out: dict[str, Any] = {"differing_bytes": 0, "intended_pages_still_canary": 0, "stray_bytes": 0}
    idx = torch.tensor(SRC_PAGES)
    for layer, (s, d) in enumerate(zip(src, dst, strict=True)):
        d_pages = _pages(d, page)
        if reference is not None:  # the decode pool's own write of the same latents
            want = _pages(reference[layer], page)[torch.tensor(dst_pages)]
            out["differing_bytes_whole_pool"] = out.get("differing_bytes_whole_pool", 0) + int(
                (d.view(torch.uint8) != reference[layer].view(torch.uint8)).sum())
        elif plugin:
            want = mla_pages_to_fp8(s.reshape(-1, page, s.shape[-1])[idx], scales[layer])
        else:
            want = _pages(s, page)[idx]
        _check(d_pages, want, dst_pages, out)
        if layer == 0:
            out["written_pages_layer0"] = [i for i in range(d_pages.shape[0]) if bool((d_pages[i] != CANARY).any())]
    out.update(equal=out["differing_bytes"] == 0, others_untouched=out["stray_bytes"] == 0, dst_pages=list(dst_pages),
               page_bytes_decode=int(dst[0][:page].numel() * dst[0].element_size()),
               page_bytes_prefill=int(src[0][:page].numel() * src[0].element_size()))
    if src_all["state"] or dst_all["state"]:  # DSA indexer K cache: pages of raw bytes, SGLang's own state copy
        state: dict[str, Any] = {"differing_bytes": 0, "intended_pages_still_canary": 0, "stray_bytes": 0,
                                 "layers": len(dst_all["state"]), "page_bytes": int(dst_all["state"][0].shape[-1])}
        for s, d in zip(src_all["state"], dst_all["state"], strict=True):
            _check(d.unsqueeze(1), s[idx].unsqueeze(1), dst_pages, state)
        state["equal"] = state["differing_bytes"] == 0 and state["layers"] == len(src_all["state"])
        out["state"] = state
    return out
