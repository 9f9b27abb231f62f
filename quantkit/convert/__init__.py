"""The conversion pipeline: source shards -> plan -> (calibration) -> per-shard workers -> publish.

    open_source(SRC)          validate config, index, every shard header, the tensor inventory
    plan_conversion           decide each tensor's fate and every output tensor's dtype/shape
    calibrate (optional)      GPTQ and/or KV statistics, layer by layer, resumable
    convert_shard x N         stream each source shard into bounded part files (+ journal entry)
    finalize + publish        final shard names, rebuilt index, config, manifest, atomic rename

A crash or Ctrl-C leaves `OUT.partial/` with a journal; rerunning the same command resumes from the
shards (and calibration layers) already finished and produces the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Protocol

import torch

from quantkit.checkpoint.qconfig import build_quantization_config
from quantkit.checkpoint.source import SourceCheckpoint, open_source
from quantkit.checkpoint.writer import PlannedTensor, StreamingShardWriter
from quantkit.convert.plan import TensorPlan, plan_conversion
from quantkit.convert.publish import (
    MANIFEST_FILE,
    RECIPE_FILE,
    account,
    carry_over_files,
    finalize_shards,
    publish,
    source_fingerprint,
    tool_versions,
    write_json,
)
from quantkit.convert.worker import ShardJob, convert_shard, journal_path, part_name
from quantkit.errors import QuantkitError
from quantkit.recipe import Recipe

if TYPE_CHECKING:  # the calibration stack imports transformers: only when a recipe calibrates
    from quantkit.calibrate.result import CalibrationResult

__all__ = ["ConvertResult", "Reporter", "check_device", "convert"]

_RUN_FILE = "run.json"
_KV_SHARD_INDEX = 99_999  # KV scales are written as one extra part after all source shards


class Reporter(Protocol):
    """Where progress goes (the CLI draws rich bars; tests pass nothing)."""

    def stage(self, name: str, total: int | None = None) -> None: ...
    def advance(self, n: int) -> None: ...
    def note(self, message: str) -> None: ...


class _Silent:
    def stage(self, name: str, total: int | None = None) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def note(self, message: str) -> None:
        pass


@dataclass
class ConvertResult:
    out: Path
    source_bytes: int
    output_bytes: int
    seconds: float
    actions: dict[str, int]
    resumed_shards: int = 0
    warnings: list[str] = field(default_factory=list)
    calibration_summary: str = ""


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    recipe: Recipe,
    workers: int = 1,
    force: bool = False,
    reporter: Reporter | None = None,
    device: str = "cpu",
) -> ConvertResult:
    """Convert SRC into an INT4 compressed-tensors checkpoint at OUT (see module docstring).

    `device` is where RTN and calibration compute ("cpu", "cuda", "cuda:1"); every device writes the same
    bytes for RTN (the CPU uses fused kernels, other devices torch ops, both bit-identical).
    """
    started = time.perf_counter()
    report = reporter or _Silent()
    device = check_device(device)
    src_path, out_path = Path(src).resolve(), Path(out).resolve()
    _check_paths(src_path, out_path, force)
    source = open_source(src_path)
    plans = plan_conversion(source, recipe)
    partial = out_path.with_name(out_path.name + ".partial")
    done = _prepare_partial(partial, source, recipe, report)

    calibration: CalibrationResult | None = None
    if recipe.needs_calibration:
        from quantkit.calibrate.runner import calibrate

        report.stage("calibrating layer by layer")
        calibration = calibrate(source, recipe, partial / "calibration", progress=report.note, device=device)

    jobs = [ShardJob(i, s, plans[s], partial, recipe, device) for i, s in enumerate(source.shard_files)
            if i not in done]
    report.stage("converting shards", total=sum(p.source.nbytes for j in jobs for p in j.plans))
    _run_jobs(source, jobs, calibration, workers, report)

    journal = [_read_journal(partial, i) for i in range(len(source.shard_files))]
    if calibration is not None and calibration.kv_scales:
        journal.append(_write_kv_scales(partial, calibration.kv_scales, source.adapter.prefix))
    weight_map = finalize_shards(partial, journal)
    output_bytes = _write_metadata(source, recipe, plans, partial, weight_map, calibration)
    publish(partial, out_path, force)
    actions: dict[str, int] = {}
    for plan in (p for ps in plans.values() for p in ps):
        actions[plan.action] = actions.get(plan.action, 0) + 1
    return ConvertResult(
        out_path, source.source_bytes, output_bytes, time.perf_counter() - started, actions, len(done),
        list(source.warnings), calibration.summary() if calibration is not None else "",
    )


def check_device(device: str) -> str:
    """A usable torch device string, or a one-line error (`cuda` asked for on a machine without one)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise QuantkitError(f"--device {device!r}: not a torch device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantkitError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise QuantkitError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) present")
    elif dev.type != "cpu":
        raise QuantkitError(f"--device {device!r}: only cpu and cuda are supported")
    return str(dev)


def _check_paths(src: Path, out: Path, force: bool) -> None:
    if out == src or out.is_relative_to(src):
        raise QuantkitError(f"{out}: refusing to write inside the source directory {src}")
    if src.is_relative_to(out):
        raise QuantkitError(f"{out}: refusing to write over a directory that contains the source")
    if out.exists() and not force:
        raise QuantkitError(f"{out}: already exists (use --force to replace it)")


def _prepare_partial(partial: Path, source: SourceCheckpoint, recipe: Recipe, report: Reporter) -> set[int]:
    """Create OUT.partial, or resume it when it was made by the same source and recipe."""
    run = {"fingerprint": source_fingerprint(source), "recipe": recipe.model_dump(mode="json"),
           "versions": tool_versions()}
    run_file = partial / "journal" / _RUN_FILE
    if partial.exists():
        try:
            same = json.loads(run_file.read_text()) == run
        except (OSError, json.JSONDecodeError):
            same = False
        if not same:
            report.note(f"discarding {partial.name}: it was made from another source, recipe or version")
            shutil.rmtree(partial)
    (partial / "parts").mkdir(parents=True, exist_ok=True)
    (partial / "journal").mkdir(parents=True, exist_ok=True)
    write_json(run_file, run)
    done = {i for i in range(len(source.shard_files)) if journal_path(partial, i).exists()}
    for part in (partial / "parts").glob("part-*.safetensors*"):
        if int(part.name.split("-")[1]) not in done:
            part.unlink()  # an unfinished shard from the interrupted run: redo it
    if done:
        report.note(f"resuming: {len(done)} of {len(source.shard_files)} shards already converted")
    return done


def _read_journal(partial: Path, index: int) -> dict[str, Any]:
    return json.loads(journal_path(partial, index).read_text())


# ---- running the shard jobs ---------------------------------------------------------------------
def _run_jobs(source: SourceCheckpoint, jobs: list[ShardJob], calibration: CalibrationResult | None, workers: int,
              report: Reporter) -> None:
    """Convert the shards with `workers` threads of this process, one shard each at a time.

    Threads, not processes: the fused kernels, torch's ops and the file I/O all release the GIL, so the
    shards convert in parallel without starting (and holding in memory) one interpreter per worker.
    On an error or Ctrl-C the other threads stop at their next tensor; their unfinished parts are
    discarded and redone on resume.
    """
    if not jobs:
        return
    if workers <= 1 or len(jobs) == 1:
        for job in jobs:
            convert_shard(source, job, calibration, on_bytes=report.advance)
        return
    progress: SimpleQueue[int] = SimpleQueue()  # bytes done, tensor by tensor; drained by this thread
    stop = threading.Event()
    pool = ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="quantkit-convert")
    pending: set[Future[dict[str, Any]]] = {
        pool.submit(convert_shard, source, job, calibration, progress.put, stop.is_set) for job in jobs}
    try:
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(progress, report)
            for future in finished:
                future.result()  # re-raise a worker's QuantkitError here
        _drain(progress, report)
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _drain(queue: SimpleQueue[int], report: Reporter) -> None:
    from queue import Empty

    while True:
        try:
            report.advance(queue.get_nowait())
        except Empty:
            return


# ---- metadata -----------------------------------------------------------------------------------
def _write_kv_scales(partial: Path, kv_scales: dict[int, tuple[float, float]], prefix: str) -> dict[str, Any]:
    """KV scales as one extra part file: `[prefix]model.layers.N.self_attn.{k,v}_scale`, float32 [1]."""
    from quantkit.calibrate.kv import scale_tensors

    tensors = scale_tensors(kv_scales, prefix)
    name = part_name(_KV_SHARD_INDEX, 0)
    writer = StreamingShardWriter(partial / "parts" / name, [PlannedTensor(n, torch.float32, (1,)) for n in tensors])
    for n, t in tensors.items():
        writer.write(n, t)
    writer.finish()
    return {"shard": "(calibrated KV-cache scales)", "parts": [name]}


def _write_metadata(
    source: SourceCheckpoint,
    recipe: Recipe,
    plans: dict[str, list[TensorPlan]],
    partial: Path,
    weight_map: dict[str, str],
    calibration: CalibrationResult | None,
) -> int:
    """config.json, index, recipe, carried-over files, reports and quantkit.json; returns output bytes."""
    copied, skipped = carry_over_files(source, partial)
    config = dict(source.config)
    ignore = source.adapter.ignore_patterns(set(recipe.quantize_roles))
    kv = calibration is not None and bool(calibration.kv_scales)
    config["quantization_config"] = build_quantization_config(recipe.group_size, ignore, kv_cache=kv)
    write_json(partial / "config.json", config)
    reports = calibration.write_reports(partial) if calibration is not None else []
    (partial / RECIPE_FILE).write_text(recipe.to_yaml(), encoding="utf-8")
    shard_bytes = {f: (partial / f).stat().st_size for f in sorted(set(weight_map.values()))}
    write_json(partial / "model.safetensors.index.json",
               {"metadata": {"total_size": _data_bytes(partial, shard_bytes)}, "weight_map": weight_map})
    tensors = account(plans, weight_map)
    summary: dict[str, dict[str, int]] = {}
    for plan in (p for ps in plans.values() for p in ps):
        row = summary.setdefault(plan.action, {"tensors": 0, "source_bytes": 0, "output_bytes": 0})
        row["tensors"] += 1
        row["source_bytes"] += plan.source.nbytes
        row["output_bytes"] += sum(o.nbytes for o in plan.outputs)
    manifest = {
        "format": "quantkit/1",
        "tool_versions": tool_versions(),
        "source": {"name": source.root.name, "fingerprint": source_fingerprint(source), "format": source.source_format,
                   "bytes": source.source_bytes, "shards": len(source.shard_files), "warnings": source.warnings},
        "recipe": recipe.model_dump(mode="json"),
        "output": {"bytes": sum(shard_bytes.values()), "shards": shard_bytes, "files_copied": copied,
                   "files_skipped": skipped, "reports": reports},
        "summary": summary,
        "tensors": tensors,
    }
    write_json(partial / MANIFEST_FILE, manifest)
    return sum(shard_bytes.values())


def _data_bytes(partial: Path, shard_bytes: dict[str, int]) -> int:
    from quantkit.checkpoint.safetensors_header import read_header

    return sum(read_header(partial / f).data_bytes for f in shard_bytes)
