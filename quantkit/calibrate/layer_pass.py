"""One decoder layer of the calibration: build it, collect statistics, GPTQ, run it again, save it.

    build it from the source (one layer in memory)          -- layers.build_layer
    pass 1: run it on the inputs, accumulating Hessians     -- only if it has modules to quantize
    GPTQ every target module with its unit's scheme         -- experts.py (routed experts), dense.py (Linears)
    pass 2: run the *quantized* layer: its outputs feed the next layer; KV statistics come from here
    write layer_NNNN.safetensors (packed results + coverage + KV stats), then drop the inputs

The driver (`runner.py`) walks the layers and keeps the work directory; see its docstring for ranks and resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantkit.arch import Adapter, KVLayout, Role, family_for
from quantkit.calibrate import layers as L
from quantkit.calibrate.act_amax import LayerAmax
from quantkit.calibrate.acts import Acts, ActsWriter
from quantkit.calibrate.asymmetric import PairedPass, quantize_experts_ordered
from quantkit.calibrate.dense import hessian_hook, linear_owners, quantize_linear, role_linears, target_linears
from quantkit.calibrate.experts import quantize_experts
from quantkit.calibrate.gptq import GPTQScheme, HessianAccumulator
from quantkit.calibrate.kv import KVStats, StatCache
from quantkit.calibrate.layer_store import fp_dir, save_layer
from quantkit.calibrate.memory import release_free_memory
from quantkit.calibrate.moe import ExpertMoE
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.quant.int4 import PackedInt4
from quantkit.quant.precision import PrecisionPlan, tensor_format
from quantkit.quant.recipe import Recipe

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["RunOptions", "forward_all", "forward_batch", "run_layer"]


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


def _experts_scheme(recipe: Recipe, adapter: Adapter, plan: PrecisionPlan | None, layer: int,
                    dtype: torch.dtype) -> GPTQScheme | None:
    """The GPTQ scheme of the layer's routed experts (its experts unit's format), None when GPTQ does not compute
    them (a dense layer, a kept or FP4 unit)."""
    if not adapter.is_moe_layer(layer):
        return None
    name = f"{adapter.prefix}model.layers.{layer}.mlp.experts.0"
    fmt = tensor_format(recipe, adapter, plan, f"{name}.gate_proj")
    if fmt is None or fmt.kind != "int":
        return None
    hidden, inter = int(adapter.config["hidden_size"]), int(adapter.config["moe_intermediate_size"])
    fmt.check_shape((inter, hidden), f"{name}.gate_proj")
    fmt.check_shape((hidden, inter), f"{name}.down_proj")
    return GPTQScheme.of(fmt, recipe.gptq, dtype)


def run_layer(source: SourceCheckpoint, cfg: PretrainedConfig, rope: nn.Module, layer: int, acts: Acts, work_dir: Path,
              recipe: Recipe, plan: PrecisionPlan | None, kv_layout: str | None, opts: RunOptions,
              device: torch.device, world: World = SINGLE, steps: int | None = None, fp_acts: Acts | None = None
              ) -> dict[str, float]:
    """Calibrate one layer and publish it; returns the seconds spent per phase (this rank's).

    What GPTQ computes and with which scheme is each unit's format (`plan`; None: the uniform recipe);
    `opts.quantize` False gathers statistics only. `fp_acts`: the full-precision stream's inputs (asymmetric
    calibration); its outputs are written too."""
    adapter = source.adapter
    dtype = source.model_dtype
    experts_scheme = _experts_scheme(recipe, adapter, plan, layer, dtype) if opts.quantize else None
    base = f"{adapter.prefix}model.layers.{layer}."
    steps = len(acts) if steps is None else steps
    phases: dict[str, float] = {}
    t = time.time()
    # the MoE inputs (of every rank's tokens) are kept when they fit in RAM; then the statistics pass needs no
    # routed expert: they are read as GPTQ needs them
    # (asymmetric calibration and gate/up-first read the experts themselves: never lazy)
    keep_inputs = acts.total <= (opts.memory_budget // 2 if fp_acts is not None else opts.memory_budget)
    lazy = (keep_inputs and experts_scheme is not None and opts.all_experts and fp_acts is None
            and recipe.gptq.expert_order == "down_first")
    module = L.build_layer(source, cfg, layer, adapter.prefix, lazy_experts=lazy, world=world).to(device)
    if hasattr(source, "close"):
        source.close()  # unmap the shards just read: their pages would otherwise stay in this process's RSS
    release_free_memory()  # at each phase boundary: what the phase freed leaves the RSS (memory.py)
    phases["load"] = time.time() - t
    moe = module.mlp if isinstance(getattr(module, "mlp", None), ExpertMoE) else None
    quantize_moe = moe is not None and experts_scheme is not None
    targets = target_linears(module, base, adapter, recipe, plan, dtype) if opts.quantize else {}
    linears = {name: lin for name, (lin, _) in targets.items()}
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
                       lambda batch: forward_batch(module, rope, batch, cfg, device, dsa, None),
                       _indexed(fp_writer, fp_acts.indices) if fp_writer is not None else None)
        else:
            hooks = [lin.register_forward_pre_hook(hessian_hook(hessians[name])) for name, lin in linears.items()]
            forward_all(module, rope, acts, cfg, device, None, None, moe, steps)
            for h in hooks:
                h.remove()
        release_free_memory()
        for acc in hessians.values():
            acc.all_reduce(world)
        if quantize_moe:
            moe.reduce_statistics()
        phases["pass1"] = time.time() - t
        t = time.time()
        if quantize_moe:
            assert experts_scheme is not None
            if paired is not None or recipe.gptq.expert_order != "down_first":
                p, coverage = quantize_experts_ordered(moe, paired, base + "mlp.experts.", layer, experts_scheme)
            else:
                p, coverage = quantize_experts(moe, base + "mlp.experts.", layer, experts_scheme)
            packed.update(p)
            moe.stop_collecting()
        owners = linear_owners(linears, world)
        for name, (lin, scheme) in targets.items():
            cross = paired.linear_cross(name) if paired is not None else None
            result = quantize_linear(lin, hessians[name].hessian(), scheme, world, owners[name], cross)
            if result is not None:
                packed[base + name], rec = result
                modules.append({"layer": layer, "module": base + name, **rec})
        del hessians  # pass-1 statistics are not needed by pass 2
        release_free_memory()
        phases["gptq"] = time.time() - t
    elif fp_writer is not None:  # nothing to quantize here: the fp stream still moves on
        forward_all(module, rope, fp_acts, cfg, device, fp_writer, None)
    if fp_writer is not None:
        fp_writer.close()
    t = time.time()
    stats = KVStats(kv_layout) if kv_layout else None
    writer = None if last else ActsWriter(work_dir / f"acts_{layer + 1:04d}", world)
    observe = None  # W4A4: each target Linear's input amax (act_amax.py)
    if recipe.scheme == "nvfp4":
        all_roles = {Role(r) for r in recipe.quantize_roles}
        observe = LayerAmax(role_linears(module, base, adapter, all_roles),
                            moe if moe is not None and Role.ROUTED_EXPERT in all_roles else None)
    if writer is not None or stats is not None or observe is not None:
        forward_all(module, rope, acts, cfg, device, writer, stats, moe, steps)
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


@torch.no_grad()
def forward_all(module: nn.Module, rope: nn.Module, acts: Acts, cfg: PretrainedConfig, device: torch.device,
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
        out, topk = forward_batch(module, rope, batch, cfg, device, dsa, cache)
        if writer is not None:
            writer.add(index, out, topk)
    if moe is not None:
        for _ in range(steps - len(acts)):
            moe.idle_step()
    if hook is not None:
        hook.remove()


@torch.no_grad()
def forward_batch(module: nn.Module, rope: nn.Module, batch: dict[str, torch.Tensor], cfg: PretrainedConfig,
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
