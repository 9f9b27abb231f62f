"""Opt-in SGLang plugin for the production PD split: the prefill keeps BF16 KV, the decode receives FP8 pages.

Enable on the **prefill** server only::

    QUANTKIT_PD_KV=bf16-to-fp8 QUANTKIT_PD_KV_DECODE=/path/to/decode/checkpoint python -m sglang.launch_server ...

Entry point `quantkit_pd_kv` (group `sglang.srt.plugins`): SGLang's `load_plugins()` calls :func:`register` in
every server process; without `QUANTKIT_PD_KV` it registers nothing. The decode server runs stock SGLang.
`QUANTKIT_PD_KV_DECODE` names the decode's checkpoint (quantkit's output): its `quantkit.json` holds the split
(`serving.sglang.pd_split`, written by `quantkit convert`, printed by `quantkit plan --pd --split`): the
decode's KV dtype string, row layout and whether its attention applies the calibrated per-layer
`k_scale` (then read from the checkpoint's own `self_attn.k_proj.k_scale` tensors, the ones the decode loads).

Hooks (all through SGLang's `HookRegistry`; SGLang is imported only inside them):

==================================================================  =============================================
SGLang 0.5.23 target                                                what the plugin does
==================================================================  =============================================
``disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager``   builds the staging (pd_staging.PageStaging)
(AROUND)                                                            for the BF16 pool (and the draft pool) before
                                                                    SGLang builds its KV manager; one-line error
                                                                    (server does not start) if it cannot
``mem_cache.memory_pool.MLATokenToKVPool.get_contiguous_buf_infos``  inside that call only: returns the staging's
(AROUND)                                                            pointers and the decode's bytes per page, so
                                                                    the transfer engine registers the staging
``disaggregation.common.conn.CommonKVManager.__init__`` (BEFORE)    the prefill advertises the decode's KV dtype
                                                                    string (`try_ensure_parallel_info` passes)
``disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache``     converts the request's pages into staging
(AROUND)                                                            slots, then SGLang's own send moves the slots
``...MooncakeKVManager.send_kvcache_dcp`` (AROUND)                  refuses (DCP relayout is not supported)
==================================================================  =============================================

Supported: MLA (DeepSeek-V3, Kimi K2) into the decode's FP8 MLA rows at its per-layer scale, and DSA (GLM-5)
into 656 B rows (per-tile scales, SGLang's own quantizer); Mooncake transfer backend (SGLang itself checks that
the page sizes match). Refused with one line: GQA pools, other transfer backends,
`--disaggregation-enable-kv-checksum` (it digests the registered buffers), DCP relayout, HiSparse destinations,
a decode item length other than the staging's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from quantkit.engines.pd import DECODE_ENV, ENV, MODE
from quantkit.serving.pd.staging import DecodeRow, PageStaging, StagedLayer, dsa_pages_to_fp8, mla_pages_to_fp8

if TYPE_CHECKING:
    import torch

__all__ = ["DECODE_ENV", "ENV", "MODE", "STAGING_ENV", "DecodeTarget", "PluginNotReady", "decode_target",
           "dsa_pages_to_fp8", "enabled", "hook_table", "mla_pages_to_fp8", "register"]

logger = logging.getLogger(__name__)
STAGING_ENV = "QUANTKIT_PD_KV_STAGING_TOKENS"  # staging size in tokens per layer (default: one 8K prefill chunk)
HookKind = Literal["AROUND", "BEFORE"]
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.k_proj\.k_scale$")


class PluginNotReady(RuntimeError):
    """The switch is on but the hand-off cannot run as configured (one line says why)."""


def enabled() -> bool:
    """Whether the plugin is switched on for this process."""
    value = os.environ.get(ENV, "")
    if value and value != MODE:
        raise PluginNotReady(f"{ENV}={value!r}: the only mode is {MODE!r} (unset it to run without the plugin)")
    return value == MODE


@dataclass(frozen=True)
class DecodeTarget:
    """What the decode server stores, from its checkpoint's PD split record."""

    checkpoint: Path
    kv_dtype: str  # the string the decode advertises (and the prefill must)
    row: DecodeRow
    scales: dict[int, float] = field(default_factory=dict)  # layer id -> k_scale its attention applies (MLA)

    def k_scale(self, layer: int) -> float:
        return self.scales.get(layer, 1.0)  # SGLang's KV method turns an unloaded scale into 1.0


def decode_target(path: str | os.PathLike[str]) -> DecodeTarget:
    """Read the decode side of `quantkit.json["serving"]["sglang"]["pd_split"]` in the decode's checkpoint, and
    its per-layer k_scale tensors when the decode's attention applies them."""
    root = Path(path)
    meta = root / "quantkit.json"
    try:
        split = json.loads(meta.read_text())["serving"]["sglang"]["pd_split"]["decode"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PluginNotReady(f"{meta}: no PD split record (serving.sglang.pd_split; `quantkit convert` writes it) "
                             f"for {DECODE_ENV}: {type(exc).__name__}: {exc}") from None
    row = split["kv_row"]
    if row not in ("mla", "dsa-656"):
        raise PluginNotReady(f"{meta}: decode KV row {row!r}: the plugin converts into 'mla' or 'dsa-656' rows only")
    scales = _k_scales(root) if split["kv_scale"] == "calibrated" else {}
    return DecodeTarget(root, str(split["kv_dtype_resolved"]), row, scales)


def _k_scales(root: Path) -> dict[int, float]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {
        n: "model.safetensors" for n in _names(root / "model.safetensors")}
    wanted: dict[str, list[tuple[int, str]]] = {}
    for name, shard in weight_map.items():
        if (m := _SCALE_NAME.search(name)) is not None:
            wanted.setdefault(shard, []).append((int(m.group(1)), name))
    if not wanted:
        raise PluginNotReady(f"{root}: the PD split says calibrated KV scales, but no self_attn.k_proj.k_scale tensor")
    scales: dict[int, float] = {}
    for shard, names in wanted.items():
        with safe_open(str(root / shard), "pt") as f:
            for layer, name in names:
                scales[layer] = float(f.get_tensor(name).float().reshape(-1)[0])
    return scales


def _names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


# ---- hooks ---------------------------------------------------------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.registered = False
        self.building: dict[int, tuple[PageStaging, int, int]] = {}  # id(pool) -> (staging, first layer, count)
        self.staging: PageStaging | None = None
        self.target: DecodeTarget | None = None
        self.lock = threading.Lock()


_STATE = _State()


# What the hooks read of SGLang's objects (SGLang is imported only inside the hooks and register()).
class _KVPool(Protocol):
    """An `MLATokenToKVPool` (checked with isinstance before any of this is read)."""

    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    start_layer: int
    layer_num: int
    use_dsa: bool
    store_dtype: torch.dtype
    kv_buffer: list[torch.Tensor]


class _ModelConfig(Protocol):
    num_hidden_layers: int


class _Scheduler(Protocol):
    model_config: _ModelConfig


class _PrefillQueue(Protocol):
    """`PrefillBootstrapQueue`: the prefill's KV pools and its scheduler."""

    token_to_kv_pool: _KVPool
    draft_token_to_kv_pool: _KVPool | None
    scheduler: _Scheduler


class _KVArgs(Protocol):
    """The `KVArgs` a KV manager is built from."""

    kv_data_ptrs: list[int]
    kv_cache_dtype_str: str


class _KVManager(Protocol):
    """A `CommonKVManager` (Mooncake's on the prefill), carrying the plugin's staging once it is built."""

    _quantkit_pd_staging: PageStaging


Hook = Callable[..., object]  # an SGLang method's replacement, called with the original (AROUND) or before it
_PREFILL = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager"
_POOL = "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.get_contiguous_buf_infos"
_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager.__init__"
_SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache"
_SEND_DCP = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache_dcp"


def _staging_tokens() -> int:
    raw = os.environ.get(STAGING_ENV, "8192")
    if not raw.isdigit() or int(raw) < 1:
        raise PluginNotReady(f"{STAGING_ENV}={raw!r}: expected a positive number of tokens")
    return int(raw)


def _pools(queue: _PrefillQueue) -> list[_KVPool]:
    return [p for p in (queue.token_to_kv_pool, queue.draft_token_to_kv_pool) if p is not None]


def _build(queue: _PrefillQueue) -> PageStaging:
    """The staging for this prefill's pools, or a one-line PluginNotReady saying why not."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.runtime_context import get_disagg

    decode = os.environ.get(DECODE_ENV)
    if not decode:
        raise PluginNotReady(f"{ENV}={MODE} needs {DECODE_ENV}=<the decode server's checkpoint directory>")
    target = decode_target(decode)
    if get_disagg().disaggregation_enable_kv_checksum:
        raise PluginNotReady(f"{ENV}: --disaggregation-enable-kv-checksum digests the registered buffers, which are "
                             "the plugin's staging; run without it")
    pools = _pools(queue)
    layers: list[StagedLayer] = []
    for pool in pools:
        if not isinstance(pool, MLATokenToKVPool) or pool.store_dtype != torch.bfloat16:
            raise PluginNotReady(f"{ENV}: the prefill's KV pool is {type(pool).__name__} "
                                 f"({getattr(pool, 'store_dtype', '?')}); the plugin converts BF16 MLA/DSA pools "
                                 "(run the prefill with --kv-cache-dtype auto on a BF16/FP8 checkpoint)")
        if getattr(pool, "layer_shard_enabled", False):
            raise PluginNotReady(f"{ENV}: layer-sharded KV pools are not supported")
        if (target.row == "dsa-656") != bool(pool.use_dsa):
            raise PluginNotReady(f"{ENV}: decode rows {target.row} but the prefill pool is "
                                 f"{'DSA' if pool.use_dsa else 'MLA'}")
        first = pool.start_layer if pool is queue.token_to_kv_pool else _draft_first_layer(queue)
        layers += [StagedLayer(buf, target.k_scale(first + i)) for i, buf in enumerate(pool.kv_buffer)]
    tokens = _staging_tokens()
    page = pools[0].page_size
    staging = PageStaging(layers, page, target.row, pools[0].kv_lora_rank, pools[0].qk_rope_head_dim,
                          slots=max(1, -(-tokens // page)))
    start = 0
    for pool in pools:
        _STATE.building[id(pool)] = (staging, start, pool.layer_num)
        start += pool.layer_num
    _STATE.target = target
    mib = sum(b.nbytes for b in staging.buffers) / 2**20
    logger.info("quantkit PD KV: prefill BF16 -> decode %s (%s rows, %d B per page%s) from %s; staging %d pages x "
                "%d layers = %.1f MiB", target.kv_dtype, target.row, staging.item_len,
                ", calibrated k_scale per layer" if target.scales else "", target.checkpoint, staging.slots,
                len(layers), mib)
    return staging


def _draft_first_layer(queue: _PrefillQueue) -> int:
    return int(queue.scheduler.model_config.num_hidden_layers)  # the NextN draft layer's id in the checkpoint


def _init_kv_manager(original: Callable[..., object], queue: _PrefillQueue, *args: object, **kwargs: object) -> object:
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t, _, _ in hook_table() if t not in HookRegistry._patched]
    if missing:
        raise PluginNotReady(f"{ENV}: SGLang did not apply the plugin's hooks on {', '.join(missing)} "
                             "(another SGLang version?); unset it and run the FP8/FP8 pair of `quantkit plan --pd`")
    with _STATE.lock:
        _STATE.staging = _build(queue)
        try:
            return original(queue, *args, **kwargs)
        finally:
            _STATE.building.clear()


def _pool_buf_infos(original: Callable[[_KVPool], tuple[list[int], list[int], list[int]]],
                    pool: _KVPool) -> tuple[list[int], list[int], list[int]]:
    entry = _STATE.building.get(id(pool))
    if entry is None:
        return original(pool)
    staging, first, count = entry
    ptrs, lens, items = staging.buf_infos()
    return ptrs[first:first + count], lens[first:first + count], items[first:first + count]


def _before_manager_init(manager: _KVManager, args: _KVArgs, disaggregation_mode: object, *rest: object,
                         **kwargs: object) -> None:
    staging = _STATE.staging
    if not _STATE.building or staging is None or getattr(disaggregation_mode, "value", "") != "prefill":
        return
    if list(args.kv_data_ptrs[:len(staging.buffers)]) != staging.buf_infos()[0]:
        return
    if type(manager).__name__ != "MooncakeKVManager":
        raise PluginNotReady(f"{ENV}: transfer backend {type(manager).__name__}; the plugin hooks Mooncake's send "
                             "(--disaggregation-transfer-backend mooncake)")
    assert _STATE.target is not None
    args.kv_cache_dtype_str = _STATE.target.kv_dtype
    manager._quantkit_pd_staging = staging


def _send_kvcache(original: Callable[..., int], manager: _KVManager, session: str, prefill_kv_indices: np.ndarray,
                  dst_kv_ptrs: list[int], dst_kv_indices: np.ndarray, executor: object, *args: object,
                  **kwargs: object) -> int:
    staging: PageStaging | None = getattr(manager, "_quantkit_pd_staging", None)
    if staging is None:
        return original(manager, session, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor, *args,
                        **kwargs)
    dst_item = kwargs.get("dst_kv_item_len")
    if dst_item is not None and dst_item != staging.item_len:
        logger.error("quantkit PD KV: decode %s has %d B per page, the staging %d B: not sent", session, dst_item,
                     staging.item_len)
        return -1
    if kwargs.get("dst_device_kv_indices") is not None:
        logger.error("quantkit PD KV: HiSparse device destinations are not supported: not sent")
        return -1
    return staging.send(prefill_kv_indices, dst_kv_indices, lambda slots, dst: original(
        manager, session, slots, dst_kv_ptrs, dst, executor, *args, **kwargs))


def _send_kvcache_dcp(original: Callable[..., int], manager: _KVManager, *args: object, **kwargs: object) -> int:
    if getattr(manager, "_quantkit_pd_staging", None) is not None:
        logger.error("quantkit PD KV: DCP relayout is not supported by the BF16 -> FP8 hand-off: not sent")
        return -1
    return original(manager, *args, **kwargs)


def hook_table() -> list[tuple[str, Hook, HookKind]]:
    """(SGLang target, hook, HookRegistry kind) for every hook the plugin installs."""
    return [(_PREFILL, _init_kv_manager, "AROUND"), (_POOL, _pool_buf_infos, "AROUND"),
            (_MANAGER, _before_manager_init, "BEFORE"), (_SEND, _send_kvcache, "AROUND"),
            (_SEND_DCP, _send_kvcache_dcp, "AROUND")]


def register() -> None:
    """SGLang plugin entry point: the hooks when QUANTKIT_PD_KV=bf16-to-fp8, else nothing. Errors that depend on
    the server (pool, checkpoint, backend) are raised when the prefill builds its KV manager, where SGLang does not
    swallow them (load_plugins logs and ignores a failing register())."""
    if not enabled() or _STATE.registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hook_table():
        HookRegistry.register(target, hook, HookType[kind])
    _STATE.registered = True
    logger.info("quantkit PD KV hand-off (%s): %d hooks registered", MODE, len(hook_table()))
