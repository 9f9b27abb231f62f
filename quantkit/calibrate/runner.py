"""The sequential calibration driver: one decoder layer at a time, straight from the source shards.

    embed the calibration tokens
    for each decoder layer, in order:
        build it from the source (one layer in memory)          -- layers.build_layer
        pass 1: run it on the inputs, accumulating Hessians     -- only if it has modules to quantize
        GPTQ every target module; swap in the dequantized weights
        pass 2: run the *quantized* layer: its outputs feed the next layer; KV statistics come from here
        write layer_NNNN.safetensors (packed results + coverage + KV stats), then drop the inputs

Activations live in `work_dir/acts_NNNN/` as one safetensors file per batch, written for every layer
boundary (that is what makes resume possible) and also kept in memory while they fit the budget.
`work_dir` survives a crash; a rerun with the same source, recipe and data skips every finished layer
and starts from the first unfinished one. A changed recipe or dataset invalidates the work directory.
MTP layers are not calibrated (they need the main model's final hidden states); the converter RTNs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantkit.arch import Adapter, KVLayout, Role, family_for
from quantkit.calibrate import layers as L
from quantkit.calibrate.asymmetric import PairedPass, quantize_experts_ordered, shifted_target
from quantkit.calibrate.gptq import HessianAccumulator, prepare, quantize_rows
from quantkit.calibrate.kv import KVStats, StatCache
from quantkit.calibrate.moe import ExpertMoE, module_errors, quantize_experts
from quantkit.calibrate.result import CalibrationResult
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.durable import write_json_atomic
from quantkit.errors import QuantkitError
from quantkit.quant.int4 import PackedInt4, dequantize_group, pack_int4
from quantkit.recipe import Recipe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["calibrate", "run", "RunOptions", "CalibrationResult"]

Progress = Callable[[str], None]


@dataclass
class RunOptions:
    """Knobs that are not part of the recipe (they do not change the result, except `quantize`)."""

    quantize: bool = True  # False: only gather KV statistics (kv-scales on an existing checkpoint)
    batch_size: int = 8  # sequences per forward
    memory_budget: int = 2 << 30  # bytes of activations kept in RAM; beyond this they are read from disk
    threads: int | None = None  # torch threads (default: min(2, cpus) on CPU)
    device: str | None = None  # "cuda" when present, else "cpu"
    all_experts: bool = True  # every calibration token through every expert for the statistics
    tokens: torch.Tensor | None = None  # pre-tokenized calibration windows (tests, benchmarks)
    extra: dict[str, Any] = field(default_factory=dict)


def calibrate(source: SourceCheckpoint, recipe: Recipe, work_dir: Path, progress: Progress | None = None,
              device: str | None = None) -> CalibrationResult:
    """The converter's entry point: GPTQ (when `recipe.method == "gptq"`) and/or KV statistics.

    `device` None picks CUDA when present (calibration is forward passes and GPTQ: a GPU helps); the
    converter passes its `--device`.
    """
    opts = RunOptions(quantize=recipe.method == "gptq", device=device)
    return run(source, recipe, Path(work_dir), progress, opts)


def run(source: SourceCheckpoint, recipe: Recipe, work_dir: Path, progress: Progress | None,
        opts: RunOptions) -> CalibrationResult:
    say = progress or (lambda _m: None)
    _threads(opts)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    adapter = source.adapter
    cfg = L.hf_config(source.config)
    tokens = opts.tokens if opts.tokens is not None else _tokens(source, recipe)
    work_dir.mkdir(parents=True, exist_ok=True)
    _check_manifest(work_dir, source, recipe, tokens, opts, say)
    kv_layout = adapter.kv_layout if recipe.kv_cache == "fp8" else None
    roles = {Role(r) for r in recipe.quantize_roles} if opts.quantize else set()
    asym = opts.quantize and recipe.method == "gptq" and recipe.gptq.asymmetric  # a full-precision stream too
    start = _first_unfinished(work_dir, adapter.num_layers, asym)
    if start == adapter.num_layers:
        say("calibration: all layers already done (resumed)")
        return CalibrationResult.load(work_dir, adapter, recipe)
    if start > 0:
        say(f"calibration: resuming at layer {start} of {adapter.num_layers}")
    else:
        _write_acts(work_dir / "acts_0000", _embed(source, tokens, opts.batch_size, adapter.prefix), None)
    rope = L.rotary(cfg)
    t0 = time.time()
    for layer in range(start, adapter.num_layers):
        t = time.time()
        budget = opts.memory_budget // 2 if asym else opts.memory_budget  # two streams share the budget
        acts = Acts.open(work_dir / f"acts_{layer:04d}", budget)
        fp_acts = (acts if layer == 0 else Acts.open(fp_dir(work_dir, layer), budget)) if asym else None
        _run_layer(source, cfg, rope, layer, acts, work_dir, recipe, roles, kv_layout, opts, device, fp_acts)
        shutil.rmtree(work_dir / f"acts_{layer:04d}", ignore_errors=True)
        if asym:
            shutil.rmtree(fp_dir(work_dir, layer), ignore_errors=True)
        say(f"calibration: layer {layer + 1}/{adapter.num_layers} done in {time.time() - t:.1f}s")
    say(f"calibration: {adapter.num_layers - start} layers in {time.time() - t0:.1f}s")
    return CalibrationResult.load(work_dir, adapter, recipe)


def _threads(opts: RunOptions) -> None:
    if opts.threads:
        torch.set_num_threads(opts.threads)
    elif not torch.cuda.is_available():
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _tokens(source: SourceCheckpoint, recipe: Recipe) -> torch.Tensor:
    from transformers import AutoTokenizer

    from quantkit.calibrate.data import calibration_tokens

    c = recipe.calibration
    if not c.dataset:
        raise QuantkitError("recipe: calibration.dataset is not set (pass --calib FILE)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.root))
    except Exception as exc:
        raise QuantkitError(f"{source.root}: cannot load the tokenizer for calibration ({exc})") from None
    return calibration_tokens(c.dataset, tokenizer, c.samples, c.seq_len, c.seed)


# ----------------------------------------------------------------------------------- resume bookkeeping
def _check_manifest(work_dir: Path, source: SourceCheckpoint, recipe: Recipe, tokens: torch.Tensor, opts: RunOptions,
                    say: Progress) -> None:
    """Invalidate `work_dir` when it was made for other inputs (source, recipe, data, mode)."""
    key = hashlib.sha256()
    key.update(tokens.numpy().tobytes())
    key.update(json.dumps(recipe.model_dump(mode="json"), sort_keys=True).encode())
    key.update(json.dumps(source.config, sort_keys=True).encode())
    key.update(repr((opts.quantize, opts.all_experts, opts.batch_size)).encode())
    manifest = {"key": key.hexdigest(), "layers": source.adapter.num_layers}
    path = work_dir / "manifest.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("key") == manifest["key"]:
            return
        say("calibration: work directory was made with other inputs; starting over")
        for p in work_dir.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    write_json_atomic(path, manifest, indent=None)


def layer_file(work_dir: Path, layer: int) -> Path:
    return work_dir / f"layer_{layer:04d}.safetensors"


def fp_dir(work_dir: Path, layer: int) -> Path:
    """The full-precision model's inputs of `layer` (asymmetric calibration); layer 0's are the embeddings."""
    return work_dir / ("acts_0000" if layer == 0 else f"fp_{layer:04d}")


def _first_unfinished(work_dir: Path, n: int, asymmetric: bool = False) -> int:
    for layer in range(n):
        if not layer_file(work_dir, layer).exists():
            # its inputs must be there (written before the previous layer's file)
            needed = [work_dir / f"acts_{layer:04d}"] + ([fp_dir(work_dir, layer)] if asymmetric else [])
            if layer > 0 and not all((d / "done").exists() for d in needed):
                raise QuantkitError(f"{work_dir}: layer {layer} inputs are missing; delete the directory to restart")
            return layer
    return n


# ---------------------------------------------------------------------------------------- activations
class Acts:
    """The inputs of one layer: batches of hidden states (+ DSA top-k indices), from RAM or disk."""

    def __init__(self, path: Path, files: list[Path], cached: list[dict[str, torch.Tensor]] | None) -> None:
        self.path, self.files, self.cached = path, files, cached

    @classmethod
    def open(cls, path: Path, budget: int) -> Acts:
        files = sorted(path.glob("b*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        cached = [_load(f) for f in files] if size <= budget else None
        return cls(path, files, cached)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.cached is not None:
            yield from self.cached
        else:
            for f in self.files:
                yield _load(f)


def _load(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


class ActsWriter:
    """Writes a layer's outputs batch by batch into a temporary directory, published by `close`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.n = 0

    def add(self, hidden: torch.Tensor, topk: torch.Tensor | None) -> None:
        t = {"hidden": hidden.detach().to("cpu", torch.float32).contiguous()}
        if topk is not None:
            t["topk"] = topk.detach().to("cpu", torch.int32).contiguous()
        save_file(t, str(self.tmp / f"b{self.n:06d}.safetensors"))
        self.n += 1

    def close(self) -> None:
        (self.tmp / "done").write_text("")
        os.replace(self.tmp, self.path)


def _write_acts(path: Path, batches: Iterator[torch.Tensor], _topk: None) -> None:
    w = ActsWriter(path)
    for h in batches:
        w.add(h, None)
    w.close()


def _embed(source: SourceCheckpoint, tokens: torch.Tensor, batch: int, prefix: str) -> Iterator[torch.Tensor]:
    table = source.read(f"{prefix}model.embed_tokens.weight", torch.float32)
    for i in range(0, tokens.shape[0], batch):
        yield nn.functional.embedding(tokens[i : i + batch], table)


# -------------------------------------------------------------------------------------- one layer
def _run_layer(source: SourceCheckpoint, cfg: PretrainedConfig, rope: nn.Module, layer: int, acts: Acts, work_dir: Path,
               recipe: Recipe,
               roles: set[Role], kv_layout: str | None, opts: RunOptions, device: torch.device,
               fp_acts: Acts | None = None) -> None:
    """`fp_acts`: the full-precision stream's inputs (asymmetric calibration); its outputs are written too."""
    adapter = source.adapter
    base = f"{adapter.prefix}model.layers.{layer}."
    module = L.build_layer(source, cfg, layer, adapter.prefix).to(device)
    if hasattr(source, "close"):
        source.close()  # unmap the shards just read: their pages would otherwise stay in this process's RSS
    moe = module.mlp if isinstance(getattr(module, "mlp", None), ExpertMoE) else None
    quantize_moe = moe is not None and Role.ROUTED_EXPERT in roles
    linears = _target_linears(module, base, adapter, roles)
    packed: dict[str, PackedInt4] = {}
    coverage: list[dict[str, Any]] = []
    modules: list[dict[str, Any]] = []
    last = layer == adapter.num_layers - 1
    fp_writer = ActsWriter(fp_dir(work_dir, layer + 1)) if fp_acts is not None and not last else None
    if quantize_moe or linears:
        hessians = {name: HessianAccumulator(lin.in_features, device) for name, lin in linears.items()}
        if quantize_moe:  # MoE inputs kept (not one Hessian per expert) when the activations fit in RAM
            moe.start_collecting("all" if opts.all_experts else "routed", keep_inputs=acts.cached is not None)
        paired = None
        if fp_acts is not None:  # both streams, batch by batch; the fp outputs are the next fp inputs
            paired = PairedPass(linears, hessians, moe if quantize_moe else None, acts.cached is not None,
                                recipe.gptq.asymmetric_down)
            dsa = family_for(cfg.model_type).kv_layout == KVLayout.DSA
            paired.run(zip(acts, fp_acts, strict=True),
                       lambda batch: _forward_batch(module, rope, batch, cfg, device, dsa, None),
                       fp_writer.add if fp_writer is not None else None)
        else:
            hooks = [lin.register_forward_pre_hook(_hessian_hook(hessians[name])) for name, lin in linears.items()]
            _forward_all(module, rope, acts, cfg, device, None, None)
            for h in hooks:
                h.remove()
        dtype = source.model_dtype
        if quantize_moe:
            if paired is not None or recipe.gptq.expert_order != "down_first":
                p, coverage = quantize_experts_ordered(moe, paired, base + "mlp.experts.", layer, recipe.group_size,
                                                       recipe.gptq, dtype)
            else:
                p, coverage = quantize_experts(moe, base + "mlp.experts.", layer, recipe.group_size, recipe.gptq,
                                               dtype)
            packed.update(p)
            moe.stop_collecting()
        for name, lin in linears.items():
            cross = paired.linear_cross(name) if paired is not None else None
            packed[base + name], rec = _quantize_linear(lin, hessians[name].hessian(), recipe, dtype, cross)
            modules.append({"layer": layer, "module": base + name, **rec})
    elif fp_writer is not None:  # nothing to quantize here: the fp stream still moves on
        _forward_all(module, rope, fp_acts, cfg, device, fp_writer, None)
    if fp_writer is not None:
        fp_writer.close()
    stats = KVStats(kv_layout) if kv_layout else None
    writer = None if last else ActsWriter(work_dir / f"acts_{layer + 1:04d}")
    if writer is not None or stats is not None:
        _forward_all(module, rope, acts, cfg, device, writer, stats)
    if writer is not None:
        writer.close()
    _save_layer(work_dir, layer, packed, coverage, modules, stats)


def _target_linears(module: nn.Module, base: str, adapter: Adapter, roles: set[Role]) -> dict[str, nn.Linear]:
    """Non-expert Linear modules of this layer whose role the recipe quantizes."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and adapter.classify(base + name + ".weight").role in roles:
            if adapter.classify(base + name + ".weight").role not in (Role.ROUTER, Role.ROUTED_EXPERT):
                out[name] = sub
    return out


def _hessian_hook(acc: HessianAccumulator) -> Callable[..., None]:
    def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
        acc.add(args[0])

    return hook


def _quantize_linear(lin: nn.Linear, h: torch.Tensor, recipe: Recipe, dtype: torch.dtype,
                     cross: torch.Tensor | None = None) -> tuple[PackedInt4, dict[str, Any]]:
    """GPTQ of one Linear; with `cross` (asymmetric calibration) against the target `W + W C H^-1`."""
    g, gs = recipe.gptq, recipe.group_size
    w = lin.weight.data
    factor = prepare(h, g.dampening_frac, g.actorder == "static")
    target = w if cross is None else shifted_target(w, cross, factor, g.asymmetric_strength)
    q, s = quantize_rows(target, factor, gs, g.block_size, dtype, g.scale_search)
    gptq_err, rtn_err = module_errors(target, q, s, h, gs, dtype)
    rec = {
        "damping": factor.damping,
        "fallback": f"rtn: {factor.failure}" if factor.failure else None,
        "rel_error": gptq_err,
        "rtn_rel_error": rtn_err,
    }
    lin.weight.data = dequantize_group(q, s, gs).to(w.dtype)
    return pack_int4(q.cpu(), s.to(dtype).cpu()), rec


@torch.no_grad()
def _forward_all(module: nn.Module, rope: nn.Module, acts: Acts, cfg: PretrainedConfig, device: torch.device,
                 writer: ActsWriter | None, stats: KVStats | None) -> None:
    """Run the layer on every input batch; write outputs and/or observe what the KV cache would hold."""
    dsa = family_for(cfg.model_type).kv_layout == KVLayout.DSA
    cache = StatCache(stats, cfg.qk_nope_head_dim if dsa else None) if stats is not None else None
    hook = None
    if dsa and stats is not None:  # DSA's cached latent: the kv_a_layernorm output (see StatCache)
        hook = module.self_attn.kv_a_layernorm.register_forward_hook(lambda _m, _a, out: stats.k.add(out))
    for batch in acts:
        out, topk = _forward_batch(module, rope, batch, cfg, device, dsa, cache)
        if writer is not None:
            writer.add(out, topk)
    if hook is not None:
        hook.remove()


@torch.no_grad()
def _forward_batch(module: nn.Module, rope: nn.Module, batch: dict[str, torch.Tensor], cfg: PretrainedConfig,
                   device: torch.device, dsa: bool, cache: StatCache | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer on one batch of inputs: its output (and DSA's top-k indices)."""
    h = batch["hidden"].to(device)
    b, s = h.shape[:2]
    pos = torch.arange(s, device=device).unsqueeze(0)
    pe = rope(h, pos)
    kwargs: dict[str, Any] = {"position_embeddings": pe, "position_ids": pos, "past_key_values": cache}
    if dsa:
        kwargs["attention_mask"] = L.causal_mask(b, s).to(device)
        kwargs["prev_topk_indices"] = batch["topk"].to(device) if "topk" in batch else None
    out = module(h, **kwargs)
    topk = None
    if isinstance(out, tuple):
        out, topk = out[0], out[1]
    return out, topk


def _save_layer(work_dir: Path, layer: int, packed: dict[str, PackedInt4], coverage: list[dict[str, Any]],
                modules: list[dict[str, Any]], stats: KVStats | None) -> None:
    """The layer's results, published atomically: its existence marks the layer as finished."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in packed.items():
        tensors.update({k: v.contiguous() for k, v in p.tensors(name).items()})
    meta = {
        "coverage": json.dumps(coverage),
        "modules": json.dumps(modules),
        "kv": json.dumps(stats.to_json() if stats else None),
    }
    path = layer_file(work_dir, layer)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
