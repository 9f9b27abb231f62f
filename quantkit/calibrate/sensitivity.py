"""Sensitivity: the predicted end-to-end KL of every quantization unit in every candidate format, streamed.

Method (Fisher information with labels sampled from the source model). For a small weight error `D` the KL
of the quantized model's next-token distributions to the source's is, summed over a sequence's tokens,
`1/2 D^T F D` with `F = sum_t E_{y_t ~ p_src}[grad log p(y_t) grad log p(y_t)^T]` (the Fisher at the source).
Sampling one label per position from the source model and back-propagating the summed log-likelihood gives
one gradient `g` per sequence with `E[g g^T] = F` (the cross terms vanish: each position's score has mean
zero under its own distribution). So `E[(g . D)^2] = 2 x the KL summed over the sequence`, and `g . D` is, to
first order, `sum_tokens g_u . delta_u`: the gradient at a unit's output times the change of that output when
the unit alone is quantized. The change is measured exactly (the unit run with its fake-quantized weights on
the source's inputs), the format's real error structure included; only its propagation through the layers
above is linearised. Predicted KL per token of unit u in format f = `mean_seq,draws (g . delta_uf)^2 / (2 s)`,
additive over units (the errors of different units are uncorrelated). docs/mixed-precision.md reports how
well it ranks units against measured KL.

Streaming, one decoder layer in memory (as the GPTQ runner):

    forward:   embed; each layer built from the source, run on its inputs, outputs written (acts_NNNN),
               every `checkpoint_every`-th boundary kept, the others deleted once used
    head:      final norm + lm_head on the last hidden states; labels sampled (seeded per batch); the
               gradient at the last hidden states (grads_NNNN)
    backward:  for each layer from the top: its inputs (recomputed from the checkpoint below if deleted), its
               gradient step (sensitivity_layer.score_batch), every unit x format scored, the input gradients
               written for the layer below; `sens_NNNN.json` marks the layer done

A rerun with the same inputs resumes at the first unfinished step. Under torchrun the batches and the
routed experts are dealt to the ranks as in the GPTQ runner (expert-parallel MoE, forward and backward).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantkit.arch import KVLayout, family_for
from quantkit.calibrate import layers as L
from quantkit.calibrate.acts import Acts, ActsWriter, write_acts
from quantkit.calibrate.memory import release_free_memory
from quantkit.calibrate.sensitivity_layer import (
    FakeQuant,
    Fits,
    LayerUnits,
    backward_batch,
    idle_backward,
    layer_call,
    score_units,
)
from quantkit.calibrate.sensitivity_table import SensitivityTable, UnitScores
from quantkit.checkpoint.source import SourceCheckpoint
from quantkit.core.distributed import SINGLE, World
from quantkit.core.durable import write_json_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import open_write, refuse_link, replace, safe_mkdir

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["SensitivityOptions", "run_sensitivity"]

Progress = Callable[[str], None]
UnitsOf = Callable[[int, nn.Module], LayerUnits]  # layer index, built decoder layer -> its units


@dataclass
class SensitivityOptions:
    formats: dict[str, FakeQuant]  # candidate format name -> fake quantizer (BF16 / "keep" needs no entry: 0 KL)
    units_of: UnitsOf
    fits: Fits | None = None  # whether a format can store a weight shape (None: every format every unit)
    draws: int = 1  # label draws per sequence (each one backward pass): lower variance, more time
    batch_size: int = 8
    # keep every k-th layer boundary of the forward pass (k > 1: less disk, the layers between run forward twice);
    # 0: automatic, every layer up to 16 layers, else every ceil(sqrt(layers))-th (GLM-5.2: 9 of 78 boundaries)
    checkpoint_every: int = 0
    memory_budget: int = 2 << 30
    seed: int = 0
    device: str | None = None
    tokens: torch.Tensor | None = None  # the calibration windows `[n, s]`
    extra: dict[str, str] = field(default_factory=dict)  # recorded in the table (method details for the docs)


def run_sensitivity(source: SourceCheckpoint, work_dir: Path, opts: SensitivityOptions,
                    progress: Progress | None = None, world: World = SINGLE) -> SensitivityTable:
    """Score every unit of `source` in every format of `opts` (see the module docstring); every rank calls it."""
    say = progress or (lambda _m: None)
    if opts.tokens is None:
        raise QuantkitError("sensitivity: no calibration tokens")
    tokens = opts.tokens
    started = time.time()
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    adapter = source.adapter
    cfg = L.hf_config(source.config)
    n_layers = adapter.num_layers
    n_batches = -(-tokens.shape[0] // opts.batch_size)
    mine = world.mine(list(range(n_batches)))
    steps = -(-n_batches // world.size)
    _manifest(work_dir, source, tokens, opts, world)
    dsa = family_for(cfg.model_type).kv_layout == KVLayout.DSA
    rope = L.rotary(cfg)
    k = opts.checkpoint_every or (1 if n_layers <= 16 else math.ceil(math.sqrt(n_layers)))
    if not _top_done(work_dir, n_layers) and not _done(_grads(work_dir, n_layers)):
        if not _done(_acts(work_dir, 0)):
            table = source.read(f"{adapter.prefix}model.embed_tokens.weight", torch.float32)
            write_acts(_acts(work_dir, 0), ((i, nn.functional.embedding(
                tokens[i * opts.batch_size : (i + 1) * opts.batch_size], table)) for i in mine), world)
            del table
        t = time.time()
        start = max(i for i in range(n_layers + 1) if _done(_acts(work_dir, i)))
        forwarded = _forward(source, cfg, rope, work_dir, start, n_layers, k, opts, device, dsa, world, mine, steps)
        if forwarded:
            say(f"sensitivity: forward pass of {forwarded} layers in {time.time() - t:.1f}s")
        _head(source, cfg, work_dir, n_layers, opts, device, world, mine)
        if world.is_main:
            shutil.rmtree(_acts(work_dir, n_layers), ignore_errors=True)
    scores: dict[str, UnitScores] = {}
    for layer in reversed(range(n_layers)):
        path = work_dir / f"sens_{layer:04d}.json"
        if path.exists():  # scored (its input gradients were published before this file)
            scores.update(UnitScores.from_json_map(json.loads(path.read_text(encoding="utf-8"))))
            continue
        t = time.time()
        if not _done(_acts(work_dir, layer)):  # deleted by the forward pass: recompute from the checkpoint below
            below = layer - layer % k
            _forward(source, cfg, rope, work_dir, below, layer, 1, opts, device, dsa, world, mine, steps)
        layer_scores = _backward_layer(source, cfg, rope, work_dir, layer, opts, device, dsa, world, mine, steps)
        if world.is_main:
            write_json_atomic(path, {u: s.to_json() for u, s in layer_scores.items()}, indent=None)
            shutil.rmtree(_grads(work_dir, layer + 1), ignore_errors=True)
            shutil.rmtree(_acts(work_dir, layer), ignore_errors=True)
        world.barrier()
        scores.update(layer_scores)
        say(f"sensitivity: layer {layer + 1}/{n_layers} scored in {time.time() - t:.1f}s")
    table = SensitivityTable(
        model_type=str(source.config.get("model_type")), layers=n_layers, formats=list(opts.formats),
        sequences=int(tokens.shape[0]), seq_len=int(tokens.shape[1]), draws=opts.draws, seed=opts.seed,
        units=dict(sorted(scores.items(), key=lambda kv: (kv[1].layer, kv[0]))), seconds=time.time() - started,
        method="fisher-sampled-labels", extra=dict(opts.extra))
    return table


# ---------------------------------------------------------------------------------------------- paths
def _acts(work_dir: Path, layer: int) -> Path:
    return work_dir / f"acts_{layer:04d}"


def _grads(work_dir: Path, layer: int) -> Path:
    return work_dir / f"grads_{layer:04d}"


def _done(d: Path) -> bool:
    return (d / "done").exists()


def _top_done(work_dir: Path, n_layers: int) -> bool:
    """The top layer has been scored already (its gradients are gone)."""
    return (work_dir / f"sens_{n_layers - 1:04d}.json").exists()


def _manifest(work_dir: Path, source: SourceCheckpoint, tokens: torch.Tensor, opts: SensitivityOptions,
              world: World) -> None:
    """Invalidate `work_dir` when it was made for other inputs."""
    key = hashlib.sha256(tokens.numpy().tobytes())
    key.update(json.dumps([sorted(opts.formats), opts.draws, opts.batch_size, opts.seed, opts.checkpoint_every,
                           source.config, source.stamps()], sort_keys=True).encode())
    digest = key.hexdigest()
    if world.is_main:
        safe_mkdir(work_dir, parents=True)
        path = work_dir / "manifest.json"
        if path.exists() and json.loads(path.read_text(encoding="utf-8")).get("key") != digest:
            for p in work_dir.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        if not path.exists():
            write_json_atomic(path, {"key": digest, "kind": "sensitivity"}, indent=None)
    world.barrier()


# --------------------------------------------------------------------------------------------- passes
def _build(source: SourceCheckpoint, cfg: PretrainedConfig, layer: int, world: World, device: torch.device
           ) -> nn.Module:
    module = L.build_layer(source, cfg, layer, source.adapter.prefix, world=world).to(device)
    if hasattr(source, "close"):
        source.close()
    return module


def _forward(source: SourceCheckpoint, cfg: PretrainedConfig, rope: nn.Module, work_dir: Path, start: int, stop: int,
             k: int, opts: SensitivityOptions, device: torch.device, dsa: bool, world: World, mine: list[int],
             steps: int) -> int:
    """Layers `start..stop-1` forward (source weights): writes each layer's outputs, keeps boundaries that are
    multiples of `k` (and the last); returns how many layers ran. Skips layers whose outputs exist."""
    ran = 0
    for layer in range(start, stop):
        if _done(_acts(work_dir, layer + 1)):
            continue
        acts = Acts.open(_acts(work_dir, layer), opts.memory_budget, mine)
        module = _build(source, cfg, layer, world, device)
        writer = ActsWriter(_acts(work_dir, layer + 1), world)
        with torch.no_grad():
            for index, batch in zip(acts.indices, acts, strict=True):
                writer.add(index, layer_call(module, rope, batch["hidden"].to(device), batch, cfg, dsa), None)
            moe = getattr(module, "mlp", None)
            for _ in range(steps - len(acts)):
                if hasattr(moe, "idle_step"):
                    moe.idle_step()
        writer.close()
        del module, acts
        release_free_memory()
        if world.is_main and layer % k:
            shutil.rmtree(_acts(work_dir, layer), ignore_errors=True)
        world.barrier()
        ran += 1
    return ran


def _head(source: SourceCheckpoint, cfg: PretrainedConfig, work_dir: Path, n_layers: int, opts: SensitivityOptions,
          device: torch.device, world: World, mine: list[int]) -> None:
    """Sample labels from the source's next-token distributions; the gradient of their log-likelihood at the
    last hidden states (`draws` per batch), chunked over positions (the head is position-wise)."""
    prefix = source.adapter.prefix
    norm_w = source.read(f"{prefix}model.norm.weight", torch.float32).to(device)
    head_name = f"{prefix}lm_head.weight"
    if head_name not in set(source.logical_names()):
        head_name = f"{prefix}model.embed_tokens.weight"  # tied embeddings
    head = source.read(head_name, torch.float32).to(device)
    eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
    acts = Acts.open(_acts(work_dir, n_layers), opts.memory_budget, mine)
    out = _grads(work_dir, n_layers)
    writer = _GradWriter(out, world)
    chunk = max(1, (1 << 28) // (4 * head.shape[0]))  # positions per chunk: ~256 MiB of logits
    for index, batch in zip(acts.indices, acts, strict=True):
        h = batch["hidden"].to(device)
        gen = torch.Generator(device="cpu").manual_seed(opts.seed * 1_000_003 + index)
        flat = h.reshape(-1, h.shape[-1])
        grads = torch.zeros((opts.draws, *flat.shape), dtype=torch.float32)
        for lo in range(0, flat.shape[0], chunk):
            x = flat[lo : lo + chunk].clone().requires_grad_(True)
            xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_w
            logp = torch.log_softmax(xn @ head.t(), dim=-1)
            probs = logp.detach().exp().cpu()
            for d in range(opts.draws):
                y = torch.multinomial(probs, 1, generator=gen).to(device)
                (g,) = torch.autograd.grad(logp.gather(-1, y).sum(), x, retain_graph=d < opts.draws - 1)
                grads[d, lo : lo + chunk] = g.detach().cpu()
        writer.add(index, grads.view(opts.draws, *h.shape))
    writer.close()
    world.barrier()  # published before any rank reads it
    del head


def _backward_layer(source: SourceCheckpoint, cfg: PretrainedConfig, rope: nn.Module, work_dir: Path, layer: int,
                    opts: SensitivityOptions, device: torch.device, dsa: bool, world: World, mine: list[int],
                    steps: int) -> dict[str, UnitScores]:
    """One layer's gradient step and unit scores; writes the gradients at its inputs (not for layer 0)."""
    acts = Acts.open(_acts(work_dir, layer), opts.memory_budget, mine)
    grads_in = _GradReader(_grads(work_dir, layer + 1), mine)
    module = _build(source, cfg, layer, world, device)
    units = opts.units_of(layer, module)
    writer = _GradWriter(_grads(work_dir, layer), world) if layer > 0 else None
    sums: dict[tuple[str, str], list[float]] = {}
    seq_len = int(opts.tokens.shape[1]) if opts.tokens is not None else 0
    # the unit scores run on groups of batches (each unit fake-quantized once per format and group); a group
    # holds its batches' inputs and gradients in RAM: as many batches as the memory budget allows
    per_batch = (2 + 2 * opts.draws) * opts.batch_size * seq_len * int(cfg.hidden_size) * 4
    group = max(1, opts.memory_budget // max(per_batch, 1))
    pairs = iter(zip(acts.indices, acts, grads_in, strict=True))
    for lo in range(0, steps, group):
        kept = []
        for _ in range(lo, min(lo + group, steps)):
            item = next(pairs, None)
            if item is None:
                idle_backward(module, opts.draws)  # this rank has no batch left: join the step's collectives
                continue
            index, batch, g_out = item
            g_in, kp = backward_batch(module, rope, cfg, batch, list(g_out), device, dsa)
            if writer is not None:
                writer.add(index, torch.stack([g.cpu() for g in g_in]))
            kept.append(kp)
        dots = score_units(module, kept, units, opts.formats, opts.fits, seq_len, opts.draws)
        del kept
        for unit, per_fmt in dots.items():
            for fmt, d in per_fmt.items():
                sq = d[:-1].double().pow(2)  # [draws, sequences]
                acc = sums.setdefault((unit, fmt), [0.0, 0.0, 0.0, 0.0])
                acc[0] += float(sq.sum())
                acc[1] += float(sq.pow(2).sum())
                acc[2] += float(sq.numel())
                acc[3] += float(d[-1].sum()) if d.numel() else 0.0  # output error energy, summed over sequences
    if writer is not None:
        writer.close()
        world.barrier()  # published before any rank reads it
    totals = _reduce(sums, world)
    out: dict[str, UnitScores] = {}
    for unit, spec in units.units.items():
        fisher, err, energy = {}, {}, {}
        for fmt in opts.formats:
            if (unit, fmt) not in totals:
                continue  # the format cannot store this unit's matrices
            s1, s2, n, e = totals[(unit, fmt)]
            mean = s1 / max(n, 1)
            var = max(s2 / max(n, 1) - mean * mean, 0.0)
            fisher[fmt] = mean / (2 * seq_len)
            err[fmt] = (var / max(n, 1)) ** 0.5 / (2 * seq_len)
            energy[fmt] = e / max(n / max(opts.draws, 1), 1) / seq_len  # per token
        out[unit] = UnitScores.combine(unit, spec.kind, layer, spec.params, fisher, err, energy)
    del module, acts
    release_free_memory()
    return out


def _reduce(sums: dict[tuple[str, str], list[float]], world: World) -> dict[tuple[str, str], tuple[float, ...]]:
    """The per-(unit, format) sums over every rank's sequences."""
    keys = sorted(sums)
    if world.size == 1 or not keys:
        return {k: tuple(sums[k]) for k in keys}
    t = world.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return {k: tuple(float(v) for v in t[i]) for i, k in enumerate(keys)}


# ------------------------------------------------------------------------------------ gradient files
class _GradWriter(ActsWriter):
    """Gradients at one layer boundary, one file per global batch: `g` `[draws, b, s, h]`."""

    def add(self, index: int, grads: torch.Tensor, topk: torch.Tensor | None = None) -> None:  # type: ignore[override]
        save_file({"g": grads.detach().to("cpu", torch.float32).contiguous()},
                  str(self.tmp / f"b{index:06d}.safetensors"))


class _GradReader:
    def __init__(self, path: Path, indices: list[int]) -> None:
        if not _done(path):
            raise QuantkitError(f"{path}: gradients missing; delete the work directory to restart")
        self.files = [path / f"b{i:06d}.safetensors" for i in indices]

    def __iter__(self):  # type: ignore[no-untyped-def]
        for f in self.files:
            with safe_open(f, framework="pt") as fh:
                yield fh.get_tensor("g")


def write_table(table: SensitivityTable, path: Path) -> None:
    """The table as JSON (atomically; never through a link)."""
    refuse_link(path)
    tmp = path.with_name(path.name + ".tmp")
    with open_write(tmp, text=True) as fh:
        fh.write(json.dumps(table.to_json(), indent=1) + "\n")
    replace(tmp, path)
