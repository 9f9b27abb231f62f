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

Across ranks (`world`, torch.distributed; every rank calls `calibrate` with the same arguments and a
`work_dir` on the filesystem they share):
- the calibration batches are dealt round-robin (batch i to rank i % N); each rank forwards only its
  own through the dense parts; `acts_NNNN/bNNNNNN.safetensors` stays keyed by the global batch index,
  so a rerun with another world size reads any batch;
- the routed experts are dealt round-robin too; a rank reads from the source only the experts it owns,
  and the MoE forward is expert-parallel (`moe.ExpertMoE`); ranks with fewer batches join the remaining
  steps without tokens;
- dense Hessians are summed over the ranks (all_reduce), the dense GPTQ solves are dealt to ranks by
  size and their codes + scales broadcast, so every rank holds the same quantized layer;
- each rank writes its packed results to `layer_NNNN.partRofN.safetensors`; after all have (a
  collective), rank 0 publishes `layer_NNNN.safetensors`: coverage, module records, KV statistics
  summed over the ranks, and the list of parts. That file is the one journal, whatever the world size.
"""

from __future__ import annotations

import gc
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
from torch import nn

from quantkit.arch import Adapter, KVLayout, Role, family_for
from quantkit.calibrate import layers as L
from quantkit.calibrate.act_amax import LayerAmax
from quantkit.calibrate.acts import Acts, ActsWriter, write_acts
from quantkit.calibrate.asymmetric import PairedPass, quantize_experts_ordered, shifted_target
from quantkit.calibrate.gptq import HessianAccumulator, prepare, quantize_rows
from quantkit.calibrate.kv import KVStats, StatCache
from quantkit.calibrate.layer_store import first_unfinished, fp_dir, save_layer
from quantkit.calibrate.memory import release_free_memory
from quantkit.calibrate.moe import ExpertMoE, module_errors, quantize_experts
from quantkit.calibrate.result import CalibrationResult
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import safe_mkdir
from quantkit.quant.int4 import PackedInt4, dequantize_group, pack_int4
from quantkit.quant.recipe import Recipe

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
              device: str | None = None, world: World = SINGLE) -> CalibrationResult:
    """The converter's entry point: GPTQ (when `recipe.method == "gptq"`) and/or KV statistics.

    `device` None picks CUDA when present (calibration is forward passes and GPTQ: a GPU helps); the
    converter passes its `--device` (per rank: `cuda:LOCAL_RANK`). With several ranks every rank calls
    this with the same arguments, `world` already started, and gets the same result.
    """
    opts = RunOptions(quantize=recipe.method == "gptq", device=device)
    return run(source, recipe, Path(work_dir), progress, opts, world)


@dataclass
class _Schedule:
    """Which calibration batches this rank forwards, and how many expert-parallel steps all ranks take."""

    batches: list[int]  # global batch indices, in order
    steps: int  # the most batches any rank has (ranks with fewer join the last steps without tokens)

    @classmethod
    def of(cls, n_batches: int, world: World) -> _Schedule:
        return cls(world.mine(list(range(n_batches))), -(-n_batches // world.size))


def run(source: SourceCheckpoint, recipe: Recipe, work_dir: Path, progress: Progress | None,
        opts: RunOptions, world: World = SINGLE) -> CalibrationResult:
    say = progress or (lambda _m: None)
    _threads(opts, world)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    adapter = source.adapter
    cfg = L.hf_config(source.config)
    asym = opts.quantize and recipe.method == "gptq" and recipe.gptq.asymmetric  # a full-precision stream too
    if world.size > 1 and opts.quantize and (asym or recipe.gptq.expert_order != "down_first"):
        raise QuantkitError("recipe: gptq.asymmetric and gptq.expert_order gate_up_first run in one process only; "
                            "start the conversion without torchrun or drop those options")
    tokens = opts.tokens if opts.tokens is not None else _tokens(source, recipe)
    _check_manifest(work_dir, source, recipe, tokens, opts, say, world)
    kv_layout = adapter.kv_layout if recipe.kv_cache == "fp8" else None
    roles = {Role(r) for r in recipe.quantize_roles} if opts.quantize else set()
    schedule = _Schedule.of(-(-tokens.shape[0] // opts.batch_size), world)
    start = first_unfinished(work_dir, adapter.num_layers, asym)
    if start == adapter.num_layers:
        say("calibration: all layers already done (resumed)")
        return CalibrationResult.load(work_dir, adapter, recipe)
    if start > 0:
        say(f"calibration: resuming at layer {start} of {adapter.num_layers}")
    else:
        write_acts(work_dir / "acts_0000", _embed(source, tokens, opts.batch_size, adapter.prefix, schedule.batches),
                    world)
    rope = L.rotary(cfg)
    t0 = time.time()
    for layer in range(start, adapter.num_layers):
        t = time.time()
        budget = opts.memory_budget // 2 if asym else opts.memory_budget  # two streams share the budget
        acts = Acts.open(work_dir / f"acts_{layer:04d}", budget, schedule.batches)
        fp_acts = None
        if asym:
            fp_acts = acts if layer == 0 else Acts.open(fp_dir(work_dir, layer), budget, schedule.batches)
        phases = _run_layer(source, cfg, rope, layer, acts, work_dir, recipe, roles, kv_layout, opts, device, world,
                            schedule.steps, fp_acts)
        del acts, fp_acts
        gc.collect()  # the layer's modules hold reference cycles: free them before the next layer is built
        release_free_memory()  # and return what they held to the system (memory.py)
        if world.is_main:  # every rank is past its reads (the layer ended with a collective)
            shutil.rmtree(work_dir / f"acts_{layer:04d}", ignore_errors=True)
            if asym:
                shutil.rmtree(fp_dir(work_dir, layer), ignore_errors=True)
        times = ", ".join(f"{k} {v:.1f}s" for k, v in phases.items())
        say(f"calibration: layer {layer + 1}/{adapter.num_layers} done in {time.time() - t:.1f}s ({times})")
    say(f"calibration: {adapter.num_layers - start} layers in {time.time() - t0:.1f}s")
    return CalibrationResult.load(work_dir, adapter, recipe)


def _threads(opts: RunOptions, world: World) -> None:
    if opts.threads:
        torch.set_num_threads(opts.threads)
    elif not torch.cuda.is_available():
        # ranks started on one machine share its cores (torchrun says how many it started here)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if world.size > 1 else 1
        torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // max(local, 1))))


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
                    say: Progress, world: World = SINGLE) -> None:
    """Invalidate `work_dir` when it was made for other inputs (source, recipe, data, mode).

    The world size is not part of the key: a rerun with another one resumes. With several ranks, all
    must have the same inputs (checked), and rank 0 alone touches the directory.
    """
    key = hashlib.sha256()
    key.update(tokens.numpy().tobytes())
    key.update(json.dumps(recipe.model_dump(mode="json"), sort_keys=True).encode())
    key.update(json.dumps(source.config, sort_keys=True).encode())
    key.update(json.dumps(source.stamps()).encode())  # a source changed (fixed) since: calibrate again
    key.update(repr((opts.quantize, opts.all_experts, opts.batch_size)).encode())
    manifest = {"key": key.hexdigest(), "layers": source.adapter.num_layers}
    keys = world.all_gather_object(manifest["key"])
    if any(k != keys[0] for k in keys):
        other = next(r for r, k in enumerate(keys) if k != keys[0])
        raise QuantkitError(f"{work_dir}: rank {other} has other calibration inputs (data, recipe or source) than "
                            "rank 0; every rank must run the same command")
    if world.is_main:
        safe_mkdir(work_dir, parents=True)  # the calibration spill: never through a link (quantkit.core.paths)
        path = work_dir / "manifest.json"
        if path.exists() and json.loads(path.read_text()).get("key") != manifest["key"]:
            say("calibration: work directory was made with other inputs; starting over")
            for p in work_dir.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if not path.exists():
            write_json_atomic(path, manifest, indent=None)
    world.barrier()


def _embed(source: SourceCheckpoint, tokens: torch.Tensor, batch: int, prefix: str,
           indices: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
    table = source.read(f"{prefix}model.embed_tokens.weight", torch.float32)
    for i in indices:
        yield i, nn.functional.embedding(tokens[i * batch : (i + 1) * batch], table)


# -------------------------------------------------------------------------------------- one layer
def _run_layer(source: SourceCheckpoint, cfg: PretrainedConfig, rope: nn.Module, layer: int, acts: Acts, work_dir: Path,
               recipe: Recipe, roles: set[Role], kv_layout: str | None, opts: RunOptions, device: torch.device,
               world: World = SINGLE, steps: int | None = None, fp_acts: Acts | None = None) -> dict[str, float]:
    """Calibrate one layer and publish it; returns the seconds spent per phase (this rank's).

    `fp_acts`: the full-precision stream's inputs (asymmetric calibration); its outputs are written too."""
    adapter = source.adapter
    base = f"{adapter.prefix}model.layers.{layer}."
    steps = len(acts) if steps is None else steps
    phases: dict[str, float] = {}
    t = time.time()
    # the MoE inputs (of every rank's tokens) are kept when they fit in RAM; then the statistics pass needs no
    # routed expert: they are read as GPTQ needs them
    # (asymmetric calibration and gate/up-first read the experts themselves: never lazy)
    keep_inputs = acts.total <= (opts.memory_budget // 2 if fp_acts is not None else opts.memory_budget)
    lazy = (keep_inputs and Role.ROUTED_EXPERT in roles and opts.all_experts and fp_acts is None
            and recipe.gptq.expert_order == "down_first")
    module = L.build_layer(source, cfg, layer, adapter.prefix, lazy_experts=lazy, world=world).to(device)
    if hasattr(source, "close"):
        source.close()  # unmap the shards just read: their pages would otherwise stay in this process's RSS
    release_free_memory()  # at each phase boundary: what the phase freed leaves the RSS (memory.py)
    phases["load"] = time.time() - t
    moe = module.mlp if isinstance(getattr(module, "mlp", None), ExpertMoE) else None
    quantize_moe = moe is not None and Role.ROUTED_EXPERT in roles
    linears = _target_linears(module, base, adapter, roles)
    packed: dict[str, PackedInt4] = {}
    coverage: list[dict[str, Any]] = []
    modules: list[dict[str, Any]] = []
    last = layer == adapter.num_layers - 1
    fp_writer = ActsWriter(fp_dir(work_dir, layer + 1)) if fp_acts is not None and not last else None
    if quantize_moe or linears:
        t = time.time()
        hessians = {name: HessianAccumulator(lin.in_features, device) for name, lin in linears.items()}
        if quantize_moe:  # MoE inputs kept (not one Hessian per expert) when the activations fit in RAM
            moe.start_collecting("all" if opts.all_experts else "routed", keep_inputs=keep_inputs, outputs=not lazy)
        paired = None
        if fp_acts is not None:  # both streams, batch by batch; the fp outputs are the next fp inputs
            paired = PairedPass(linears, hessians, moe if quantize_moe else None, keep_inputs,
                                recipe.gptq.asymmetric_down)
            dsa = family_for(cfg.model_type).kv_layout == KVLayout.DSA
            paired.run(zip(acts, fp_acts, strict=True),
                       lambda batch: _forward_batch(module, rope, batch, cfg, device, dsa, None),
                       _indexed(fp_writer, fp_acts.indices) if fp_writer is not None else None)
        else:
            hooks = [lin.register_forward_pre_hook(_hessian_hook(hessians[name])) for name, lin in linears.items()]
            _forward_all(module, rope, acts, cfg, device, None, None, moe, steps)
            for h in hooks:
                h.remove()
        release_free_memory()
        for acc in hessians.values():
            acc.all_reduce(world)
        if quantize_moe:
            moe.reduce_statistics()
        phases["pass1"] = time.time() - t
        t = time.time()
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
        owners = _linear_owners(linears, world)
        for name, lin in linears.items():
            cross = paired.linear_cross(name) if paired is not None else None
            result = _quantize_linear(lin, hessians[name].hessian(), recipe, dtype, world, owners[name], cross)
            if result is not None:
                packed[base + name], rec = result
                modules.append({"layer": layer, "module": base + name, **rec})
        del hessians  # pass-1 statistics are not needed by pass 2
        release_free_memory()
        phases["gptq"] = time.time() - t
    elif fp_writer is not None:  # nothing to quantize here: the fp stream still moves on
        _forward_all(module, rope, fp_acts, cfg, device, fp_writer, None)
    if fp_writer is not None:
        fp_writer.close()
    t = time.time()
    stats = KVStats(kv_layout) if kv_layout else None
    writer = None if last else ActsWriter(work_dir / f"acts_{layer + 1:04d}", world)
    observe = None  # W4A4: each target Linear's input amax (act_amax.py)
    if recipe.scheme == "nvfp4":
        all_roles = {Role(r) for r in recipe.quantize_roles}
        observe = LayerAmax(_target_linears(module, base, adapter, all_roles),
                            moe if moe is not None and Role.ROUTED_EXPERT in all_roles else None)
    if writer is not None or stats is not None or observe is not None:
        _forward_all(module, rope, acts, cfg, device, writer, stats, moe, steps)
    if writer is not None:
        writer.close()
    amax = observe.finish(base, world) if observe is not None else None
    phases["pass2"] = time.time() - t
    t = time.time()
    save_layer(work_dir, layer, packed, coverage, modules, stats, world, [base + n for n in linears], amax)
    del packed
    phases["save"] = time.time() - t
    return phases


def _indexed(writer: ActsWriter, indices: list[int]) -> Callable[[torch.Tensor, torch.Tensor | None], None]:
    """`writer.add` for outputs arriving in the order of `indices` (the global batch indices)."""
    it = iter(indices)
    return lambda out, topk: writer.add(next(it), out, topk)


def _linear_owners(linears: dict[str, nn.Linear], world: World) -> dict[str, int]:
    """The rank that solves each dense Linear: dealt by GPTQ cost (~ in^2 (in + out)), largest first."""
    names = list(linears)
    cost = [linears[n].in_features ** 2 * (linears[n].in_features + linears[n].out_features) for n in names]
    owner = dict.fromkeys(names, 0)
    for r in range(world.size):
        for i in World(r, world.size).balanced(cost):
            owner[names[i]] = r
    return owner


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


def _quantize_linear(lin: nn.Linear, h: torch.Tensor, recipe: Recipe, dtype: torch.dtype, world: World = SINGLE,
                     owner: int = 0, cross: torch.Tensor | None = None) -> tuple[PackedInt4, dict[str, Any]] | None:
    """GPTQ of one dense Linear on rank `owner`; every rank gets its codes and scales (a broadcast) and swaps
    in the dequantized weight. Returns the packed result and its record on the owner, None elsewhere.
    With `cross` (asymmetric calibration, one process) GPTQ fits the target `W + W C H^-1`."""
    g, gs = recipe.gptq, recipe.group_size
    w = lin.weight.data
    mine = owner == world.rank
    if mine:
        factor = prepare(h, g.dampening_frac, g.actorder == "static")
        target = w if cross is None else shifted_target(w, cross, factor, g.asymmetric_strength)
        q, s = quantize_rows(target, factor, gs, g.block_size, dtype, g.scale_search, g.refit_scales)
        gptq_err, rtn_err = module_errors(target, q, s, h, gs, dtype)
        rec = {
            "damping": factor.damping,
            "fallback": f"rtn: {factor.failure}" if factor.failure else None,
            "rel_error": gptq_err,
            "rtn_rel_error": rtn_err,
        }
    else:
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        s = torch.empty((w.shape[0], w.shape[1] // gs), dtype=dtype, device=w.device)
    q, s = world.broadcast_exact(q, owner), world.broadcast_exact(s, owner)
    lin.weight.data = dequantize_group(q, s, gs).to(w.dtype)
    return (pack_int4(q.cpu(), s.to(dtype).cpu()), rec) if mine else None


@torch.no_grad()
def _forward_all(module: nn.Module, rope: nn.Module, acts: Acts, cfg: PretrainedConfig, device: torch.device,
                 writer: ActsWriter | None, stats: KVStats | None, moe: ExpertMoE | None = None,
                 steps: int = 0) -> None:
    """Run the layer on this rank's input batches; write outputs and/or observe what the KV cache would hold.

    With several ranks the MoE steps are collectives: after its own batches, a rank joins the remaining
    `steps` without tokens."""
    dsa = family_for(cfg.model_type).kv_layout == KVLayout.DSA
    cache = StatCache(stats, cfg.qk_nope_head_dim if dsa else None) if stats is not None else None
    hook = None
    if dsa and stats is not None:  # DSA's cached latent: the kv_a_layernorm output (see StatCache)
        hook = module.self_attn.kv_a_layernorm.register_forward_hook(lambda _m, _a, out: stats.k.add(out))
    for index, batch in zip(acts.indices, acts, strict=True):
        out, topk = _forward_batch(module, rope, batch, cfg, device, dsa, cache)
        if writer is not None:
            writer.add(index, out, topk)
    if moe is not None:
        for _ in range(steps - len(acts)):
            moe.idle_step()
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
