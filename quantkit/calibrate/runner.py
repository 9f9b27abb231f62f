"""The sequential calibration driver: one decoder layer at a time, straight from the source shards.

    embed the calibration tokens
    for each decoder layer, in order:                           -- layer_pass.run_layer
        build it from the source (one layer in memory)
        pass 1: run it on the inputs, accumulating Hessians     -- only if it has modules to quantize
        GPTQ every target module with its unit's scheme; swap in the dequantized weights
        pass 2: run the *quantized* layer: its outputs feed the next layer; KV statistics come from here
        write layer_NNNN.safetensors (packed results + coverage + KV stats), then drop the inputs

Each unit's format (a per-unit plan: `Recipe.units`, quantkit/quant/precision.py) decides what GPTQ computes in
a layer and with which bits and group; a uniform recipe is the plan whose units follow its roles.

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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantkit.calibrate import layers as L
from quantkit.calibrate.acts import Acts, write_acts
from quantkit.calibrate.layer_pass import RunOptions, run_layer
from quantkit.calibrate.layer_store import first_unfinished, fp_dir
from quantkit.calibrate.memory import release_free_memory
from quantkit.calibrate.result import CalibrationResult
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import safe_mkdir
from quantkit.quant.precision import resolve_precision
from quantkit.quant.recipe import Recipe

__all__ = ["calibrate", "run", "RunOptions", "CalibrationResult"]

Progress = Callable[[str], None]


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
    plan = resolve_precision(recipe, adapter) if recipe.mixed else None
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
        phases = run_layer(source, cfg, rope, layer, acts, work_dir, recipe, plan, kv_layout, opts, device, world,
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
