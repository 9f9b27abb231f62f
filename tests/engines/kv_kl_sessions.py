"""SGLang's KV write and attention read for one KV configuration of the KL harness (`run_sglang_kv_kl.py`).

A session holds SGLang's real KV pool (`MLATokenToKVPool` / `MHATokenToKVPool`, CPU) and the backend objects
(made without their constructors, as `run_sglang_attn.py` does) and attends one layer of one window:

- prompt positions (< P): their rows are written by the path SGLang's prefill takes for the configuration --
  `set_mla_kv_buffer` (the MLA prefill's MHA path: a plain cast; `forward_mha.py: _set_mla_kv_buffer`) or
  `set_kv_buffer` of the rows divided by `k_scale` (the triton backend's extend path; GQA: the scales handed to
  the pool, which divides). Their outputs are the BF16 attention over the prompt's own rows: with no cached
  prefix every backend's extend attends over the chunk's unquantized K/V, so they are the same in every
  configuration and the configurations differ only in the KV the prefill leaves behind.
- decode positions (>= P): one decode batch, request t at seq_len t + 1 writing its own row, through the
  backend's own `forward_decode` (torch_native, triton, flashmla): its write (divide or not) and its read. The
  triton kernel runs for real under the Triton interpreter (`kernel="executed"`), or is replaced by the torch
  reproduction of `kv_reference.py` (`"reference"`), or both on the same inputs (`"check"`: the kernel's
  output is used, the largest difference to the reproduction recorded). FlashMLA's kernel is the reproduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch

Backend = Literal["torch_native", "triton", "flashmla"]
Write = Literal["plain", "divided"]
Kernel = Literal["reference", "executed", "check"]
H200_SMS = 132
MLA_PAD = (256, 32)  # SGLang's Triton MLA decode takes Lk 576 or 288: the tiny latent (64 + 16) zero-padded


@dataclass(frozen=True)
class KVConfig:
    """One column of the KL table: the KV dtype, the scale the layer holds, who writes and who reads."""

    name: str
    kv: Literal["bf16", "fp8"]
    read: Backend
    scale: Literal["unit", "calibrated"]
    prompt: Write  # how the prefill wrote the prompt rows
    decode_write: Literal["backend", "divided"] = "backend"  # divided: rows written / s, read by `read` at 1.0
    what: str = ""


def _anything() -> Any:
    from run_sglang_attn import Anything

    return Anything()


class Session:
    """One configuration's pool and backends for one model geometry (MLA or GQA)."""

    def __init__(self, cfg: KVConfig, mla: bool, layers: int, heads: int, kv_heads: int, head_dim: int,
                 v_dim: int, seq: int, scales: dict[int, tuple[float, float]], max_context: int,
                 kernel: Kernel) -> None:
        import run_sglang_attn as attn
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend, _mla_decode_kv_splits_cap
        from sglang.srt.runtime_context import get_exec

        self.cfg, self.mla, self.heads, self.kv_heads = cfg, mla, heads, kv_heads
        self.kernel = kernel
        self.max_diff = 0.0
        dtype = torch.float8_e4m3fn if cfg.kv == "fp8" else torch.bfloat16
        self.page = 64 if cfg.read == "flashmla" else 1
        size = self.page * math.ceil(seq / self.page) + self.page
        if mla:
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

            self.lk, self.lv = sum(MLA_PAD), MLA_PAD[0]
            self.pool = MLATokenToKVPool(size=size, page_size=self.page, dtype=dtype, kv_lora_rank=MLA_PAD[0],
                                         qk_rope_head_dim=MLA_PAD[1], layer_num=layers, device="cpu",
                                         enable_memory_saver=False)
        else:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

            self.lk, self.lv = head_dim, v_dim
            self.pool = MHATokenToKVPool(size=size, page_size=self.page, dtype=dtype, head_num=kv_heads,
                                         head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False)
        self.scales = {i: ((1.0, 1.0) if cfg.scale == "unit" else s) for i, s in scales.items()}
        req_to_token = SimpleNamespace(req_to_token=torch.arange(size, dtype=torch.int64)[None])
        self.native = object.__new__(TorchNativeAttnBackend)
        self.native.__dict__.update(forward_metadata=None, device="cpu", req_to_token_pool=req_to_token,
                                    token_to_kv_pool=self.pool, use_sliding_window_kv_pool=False,
                                    swa_out_cache_loc=None)
        base = get_exec().kernel.triton_attention_num_kv_splits
        splits = _mla_decode_kv_splits_cap(base, H200_SMS, max_context) if mla else base
        self.triton = attn._backend(TritonAttnBackend, self.pool, {
            **attn.BACKENDS["triton"]["attrs"], "use_mla": mla, "max_kv_splits": splits, "page_size": self.page,
            "num_head": heads, "num_kv_head": 1 if mla else kv_heads, "device_core_count": H200_SMS,
            "static_kv_splits": False, "split_tile_size": None, "is_draft_runner": False})
        self.split_cache: dict[int, int] = {}
        self.flashmla: Any = None
        if cfg.read == "flashmla":
            import kv_reference
            import sglang.srt.layers.attention.flashmla_backend as fm

            fm.flash_mla_with_kvcache = kv_reference.flash_mla_with_kvcache
            fm.scaled_fp8_quant = kv_reference.scaled_fp8_quant
            self.flashmla = attn._backend(fm.FlashMLABackend, self.pool, {
                "is_fp8_kvcache": cfg.kv == "fp8", "kv_lora_rank": MLA_PAD[0], "qk_rope_head_dim": MLA_PAD[1],
                "page_size": self.page})
        self._kernel()

    # ---- the triton kernel, or its reproduction ----------------------------------------------------------
    def _kernel(self) -> None:
        import kv_reference
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

        if self.kernel == "reference":
            self.triton.decode_attention_fwd = kv_reference.decode_attention_fwd
        elif self.kernel == "executed":
            self.triton.decode_attention_fwd = decode_attention_fwd
        else:
            def both(q: Any, k_buf: Any, v_buf: Any, o: Any, *args: Any, **kwargs: Any) -> None:
                ref = torch.empty_like(o)
                kv_reference.decode_attention_fwd(q, k_buf, v_buf, ref, *args, **kwargs)
                decode_attention_fwd(q, k_buf, v_buf, o, *args, **kwargs)
                scale = float(o.float().abs().max()) or 1.0
                self.max_diff = max(self.max_diff, float((o.float() - ref.float()).abs().max()) / scale)

            self.triton.decode_attention_fwd = both

    def _splits(self, lengths: torch.Tensor) -> torch.Tensor:
        """SGLang's per-request split count (`get_num_kv_splits`, executed), each request as a batch of one."""
        out = []
        for n in lengths.tolist():
            if n not in self.split_cache:
                got = torch.zeros(1, dtype=torch.int32)
                self.triton.get_num_kv_splits(got, torch.tensor([n], dtype=torch.int32))
                self.split_cache[n] = int(got[0])
            out.append(self.split_cache[n])
        return torch.tensor(out, dtype=torch.int32)

    # ---- one layer -------------------------------------------------------------------------------------
    def layer_ns(self, layer: int, scaling: float) -> SimpleNamespace:
        k, v = self.scales[layer]
        return SimpleNamespace(layer_id=layer, tp_q_head_num=self.heads, tp_k_head_num=1 if self.mla else self.kv_heads,
                               tp_v_head_num=1 if self.mla else self.kv_heads, qk_head_dim=self.lk,
                               head_dim=self.lk, v_head_dim=self.lv, scaling=scaling, logit_cap=0.0,
                               logit_capping_method="tanh", sliding_window_size=None, xai_temperature_len=-1,
                               is_cross_attention=False, k_scale=torch.tensor(k), v_scale=torch.tensor(v),
                               k_scale_float=k, v_scale_float=v)

    def write_prompt(self, layer: SimpleNamespace, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prefill's write of rows [0, P) (k: [P, KVH, Lk], v: [P, KVH, Lv], BF16)."""
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        loc = KVWriteLoc(torch.arange(k.shape[0]))
        if self.mla and self.cfg.prompt == "plain":  # MHA prefill path: forward_mha.py: _set_mla_kv_buffer
            self.pool.set_mla_kv_buffer(layer, loc, k[..., :self.lv].clone(), k[..., self.lv:].clone())
        elif self.mla:  # triton_backend.py: forward_extend, MLA: k.clone().div_(layer.k_scale), set_kv_buffer
            self.pool.set_kv_buffer(layer, loc, k.clone().div_(layer.k_scale), v)
        elif self.cfg.prompt == "plain":
            self.pool.set_kv_buffer(layer, loc, k.clone(), v.clone())
        else:  # triton_backend.py: forward_extend -> _set_kv_buffer(..., layer.k_scale, layer.v_scale)
            self.pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), layer.k_scale, layer.v_scale)

    def decode(self, layer: SimpleNamespace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int) -> torch.Tensor:
        """Decode requests at positions start..start+n-1 (q [n, H, Lk] BF16; k, v their new rows): [n, H, Lv]."""
        n = q.shape[0]
        pos = torch.arange(start, start + n)
        lengths = pos + 1
        batch = _anything()
        batch.__dict__.update(batch_size=n, out_cache_loc=pos, seq_lens=lengths, seq_lens_cpu=lengths,
                              seq_lens_sum=int(lengths.sum()), req_pool_indices=torch.zeros(n, dtype=torch.int64),
                              encoder_lens=None, spec_info=None)
        batch.forward_mode = SimpleNamespace(is_decode=lambda: True)
        qf = q.reshape(n, -1)
        if self.cfg.decode_write == "divided":  # rows written / s by the triton decode (or the PD plugin) ...
            self._triton_meta(lengths, raise_at_kernel=True)
            from run_sglang_attn import KernelReached

            try:
                self.triton.forward_decode(qf.clone(), k.clone(), v.clone(), layer, batch, save_kv_cache=True)
            except KernelReached:
                pass
            reader, save = self._reader(), False  # ... and read at 1.0 by another backend
            layer = SimpleNamespace(**{**vars(layer), "k_scale": None, "v_scale": None})
        else:
            reader, save = self._reader(), True
        if reader is self.triton:
            self._triton_meta(lengths)
        elif reader is self.flashmla:
            pages = torch.arange(math.ceil(int(lengths.max()) / self.page))
            self.flashmla.forward_metadata = _anything()
            self.flashmla.forward_metadata.__dict__.update(block_kv_indices=pages[None].repeat(n, 1))
        out = reader.forward_decode(qf, k.clone(), v.clone(), layer, batch, save_kv_cache=save)
        return out.reshape(n, self.heads, self.lv)

    def _reader(self) -> Any:
        return {"torch_native": self.native, "triton": self.triton, "flashmla": self.flashmla}[self.cfg.read]

    def _triton_meta(self, lengths: torch.Tensor, raise_at_kernel: bool = False) -> None:
        n, max_splits = lengths.shape[0], self.triton.max_kv_splits
        meta = _anything()
        meta.__dict__.update(
            kv_indptr=torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)]),
            kv_indices=torch.cat([torch.arange(int(x)) for x in lengths]).to(torch.int32),
            attn_logits=torch.zeros(n, self.heads, max_splits, self.lv),
            attn_lse=torch.zeros(n, self.heads, max_splits),
            num_kv_splits=self._splits(lengths))
        self.triton.forward_metadata = meta
        if raise_at_kernel:
            from run_sglang_attn import _recorder

            self.triton.decode_attention_fwd = _recorder([], "decode_attention_fwd")
        else:
            self._kernel()


def fp8_bands(x: torch.Tensor, scale: float) -> dict[str, int]:
    """Counts of values of x that, stored as e4m3 at `scale` (x / scale cast as SGLang's pools cast it), saturate
    (|x / s| > 448), become zero (x != 0 stored as 0) or land among the subnormals (0 < |stored| < 2^-6)."""
    y = x.float() / scale
    stored = y.to(torch.float8_e4m3fn).float()
    nonzero = x != 0
    return {"values": x.numel(), "saturated": int((y.abs() > 448).sum()),
            "zero": int((nonzero & (stored == 0)).sum()),
            "subnormal": int(((stored != 0) & (stored.abs() < 2 ** -6)).sum())}
