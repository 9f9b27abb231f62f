"""The conversion pipeline: source shards -> plan -> (calibration) -> per-shard workers -> publish.

    open_source(SRC)          validate config, index, every shard header, the tensor inventory
    plan_conversion           decide each tensor's fate and every output tensor's dtype/shape
    calibrate (optional)      GPTQ and/or KV statistics, layer by layer, resumable
    convert_shard x N         stream each source shard into bounded part files (+ journal entry)
    finalize + publish        final shard names, rebuilt index, config, manifest, atomic rename

A crash, kill -9, Ctrl-C or full disk leaves `OUT.partial/` with a journal; rerunning the same command
resumes from the shards (and calibration layers) already finished and produces the same bytes. Every
step after the last shard is idempotent too (see `quantkit.convert.publish`). `OUT.partial/.quantkit.lock`
keeps a second run off the same OUT; the kernel releases it when its process dies, so a killed run's
lock is taken over. A free-space preflight refuses a run that cannot fit before anything is written.

Under torchrun every rank runs `convert` (`quantkit.convert.ranks`): each validates the source, rank 0
alone locks, resumes or discards OUT.partial, finalizes and publishes; the pending source shards are split
across the ranks, and their journal entries are the one journal, so any world size resumes any run and
writes the same bytes (docs/distributed.md).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from quantkit.arch import Adapter
from quantkit.checkpoint.qconfig import build_fp4_quantization_config, build_quantization_config
from quantkit.checkpoint.source import SourceCheckpoint, open_source
from quantkit.checkpoint.writer import PlannedTensor, StreamingShardWriter
from quantkit.convert.partial import check_out, check_paths, kept, prepare_partial, read_journal, resumable
from quantkit.convert.plan import TensorAction, TensorPlan, plan_conversion
from quantkit.convert.publish import (
    MANIFEST_FILE,
    RECIPE_FILE,
    account,
    carry_over_files,
    finalize_shards,
    is_finished,
    publish,
    run_identity,
)
from quantkit.convert.ranks import (
    DIST_DIR,
    check_same_run,
    check_shared_dir,
    every_rank,
    join,
    on_main,
    write_nonce,
)
from quantkit.convert.space import NeededBytes, planned_bytes, preflight
from quantkit.convert.worker import ShardJob, convert_shard, part_name
from quantkit.core.distributed import RankFailed, World, clear_failures
from quantkit.core.durable import RunLock, is_no_space, no_space_error, tree_bytes, write_json_atomic, write_text_atomic
from quantkit.core.errors import QuantkitError
from quantkit.core.paths import make_parents
from quantkit.core.progress import Reporter, Silent
from quantkit.engines.record import serving_record
from quantkit.engines.verdicts import facts_from_checkpoint, unloadable_roles
from quantkit.hub import read_origin
from quantkit.hub.card import write_card
from quantkit.quant.recipe import Recipe

if TYPE_CHECKING:  # the calibration stack imports transformers: only when a recipe calibrates
    from quantkit.calibrate.result import CalibrationResult

__all__ = ["ConvertResult", "Reporter", "check_device", "check_recipe_loadable", "convert"]

_KV_SHARD_INDEX = 99_999  # KV scales are written as one extra part after all source shards


@dataclass
class ConvertResult:
    out: Path
    source_bytes: int
    output_bytes: int
    seconds: float
    actions: dict[TensorAction, int]
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
    device: str = "auto",
    world: World | None = None,
) -> ConvertResult:
    """Convert SRC into an INT4 compressed-tensors checkpoint at OUT (see module docstring).

    `device` is where RTN and calibration compute ("auto": CUDA when present; "cpu", "cuda", "cuda:1"); every
    device writes the same bytes for RTN (the CPU uses fused kernels, other devices torch ops, both bit-identical).
    `world` is the set of ranks this process is one of: None reads torchrun's environment
    (`World.from_env`; one process outside torchrun). Every rank calls `convert` with the same arguments;
    rank 0 alone reports progress, holds the lock and publishes (docs/distributed.md).
    """
    started = time.perf_counter()
    device = check_device(device)
    world = World.from_env(device) if world is None else world
    report = (reporter or Silent()) if world.is_main else Silent()
    device = check_device(world.device(device))  # cuda:LOCAL_RANK for a rank of a CUDA run
    out_path = Path(os.path.abspath(out))  # OUT itself is not resolved: a link there is refused, not followed
    src_path, out_path = Path(src).resolve(), out_path.parent.resolve() / out_path.name
    partial = out_path.with_name(out_path.name + ".partial")
    join(world)
    with world.guard(lambda: partial / DIST_DIR if partial.is_dir() and not partial.is_symlink() else None):
        result = _convert(src_path, out_path, partial, recipe, workers, force, report, device, world)
    world.stop()
    result.seconds = time.perf_counter() - started
    return result


def _convert(
    src: Path, out: Path, partial: Path, recipe: Recipe, workers: int, force: bool, report: Reporter, device: str,
    world: World,
) -> ConvertResult:
    """The run's steps, in the same order on every rank (see `quantkit.convert.ranks`)."""

    def validate() -> tuple[SourceCheckpoint, dict[str, list[TensorPlan]], dict[str, Any]]:
        check_paths(src, out)
        source = open_source(src)
        check_recipe_loadable(source.adapter, recipe)
        plans = plan_conversion(source, recipe)
        return source, plans, run_identity(source, recipe.model_dump(mode="json"))

    source, plans, identity = every_rank(world, validate)  # each rank reads the source itself: same errors
    if world.size > 1:
        check_same_run(world, identity, src)
    needed = planned_bytes(source, plans, recipe)
    calibration: CalibrationResult | None = None
    with ExitStack() as lock_held, _user_errors(partial, needed):
        start = on_main(world, lambda: _start(source, identity, partial, out, force, needed, report, world,
                                              lock_held))
        if not start["published"]:
            if world.size > 1:
                check_shared_dir(world, partial / DIST_DIR, start["nonce"])
            try:
                calibration = _convert_shards(source, plans, recipe, partial, set(start["done"]), workers, report,
                                              device, world)
            except RankFailed:
                raise
            except QuantkitError as exc:  # bad input found after work started: say what stays and why
                raise QuantkitError(f"{exc}; {kept(partial, source, recipe)}") from None
            world.barrier()  # every rank's shards are journaled; a rank that failed never arrives (World.guard)
            on_main(world, lambda: _finish(source, plans, recipe, identity, partial, out, force, calibration))
    actions: dict[TensorAction, int] = {}
    for plan in (p for ps in plans.values() for p in ps):
        actions[plan.action] = actions.get(plan.action, 0) + 1
    return ConvertResult(
        out, source.source_bytes, _output_bytes(out), 0.0, actions, len(start["done"]), list(source.warnings),
        calibration.summary() if calibration is not None else "",
    )


class _Start(TypedDict):
    """What rank 0 decided before the work starts (sent to every rank)."""

    published: bool  # the partial held a finished conversion: rank 0 just published it
    done: list[int]  # source shards already journaled by an earlier run (any world size)
    nonce: str  # written to OUT.partial/dist/ for the shared-filesystem check ("" for one process)


def _start(
    source: SourceCheckpoint, identity: dict[str, Any], partial: Path, out: Path, force: bool, needed: NeededBytes,
    report: Reporter, world: World, lock_held: ExitStack,
) -> _Start:
    """Rank 0: OUT checks, free-space preflight, the run lock (kept in `lock_held` until the end), then
    resume or discard OUT.partial; with several ranks, clear old failure records and write the nonce."""
    check_out(out, identity, force)
    make_parents(out)  # a fresh OUT path: its missing parents, each created under the path rule
    preflight(partial, needed, resumable(partial, identity))
    lock = RunLock(partial)
    created = not partial.exists()
    lock_held.enter_context(lock.held())
    if out.exists() and not force:  # published by another run while we waited for the lock
        if created:
            shutil.rmtree(partial, ignore_errors=True)
        check_out(out, identity, force)
    if lock.previous_owner:
        report.note(f"taking over {partial.name} from a run that stopped ({lock.previous_owner})")
    if is_finished(partial, identity):  # killed after the metadata was complete: only publishing is left
        report.note(f"resuming: {partial.name} holds a finished conversion; publishing it")
        write_card(partial)  # deterministic from quantkit.json: a kill before it was written loses nothing
        publish(partial, out, force)
        return {"published": True, "done": list(range(len(source.shard_files))), "nonce": ""}
    done = prepare_partial(partial, source, identity, report)
    nonce = ""
    if world.size > 1:
        clear_failures(partial / DIST_DIR)
        nonce = write_nonce(partial / DIST_DIR)
    return {"published": False, "done": sorted(done), "nonce": nonce}


def _convert_shards(
    source: SourceCheckpoint, plans: dict[str, list[TensorPlan]], recipe: Recipe, partial: Path, done: set[int],
    workers: int, report: Reporter, device: str, world: World,
) -> CalibrationResult | None:
    """Every rank: calibration (when the recipe calibrates), then this rank's share of the pending shards."""
    calibration: CalibrationResult | None = None
    if recipe.needs_calibration:
        from quantkit.calibrate.runner import calibrate

        report.stage("calibrating layer by layer")
        calibration = calibrate(source, recipe, partial / "calibration", progress=report.note, device=device,
                                world=world)
    jobs = [ShardJob(i, s, plans[s], partial, recipe, device) for i, s in enumerate(source.shard_files)
            if i not in done]
    if recipe.fp4 == "nvfp4" and jobs:
        _share_global_scales(source, plans, partial, workers, report, world)
    if recipe.scheme == "nvfp4" and calibration is not None:  # W4A4: input_global_scale per fused group
        from quantkit.convert.fp4 import input_group_amax

        quantized = [p for ps in plans.values() for p in ps if p.action == "quantize"]
        amax = input_group_amax([p.module for p in quantized], calibration.input_amax)
        for plan in quantized:
            plan.input_amax = amax[plan.module]
    mine = [jobs[k] for k in world.balanced([sum(p.source.nbytes for p in j.plans) for j in jobs])]
    if world.size > 1:
        report.note(f"{world.size} ranks: rank 0 converts {len(mine)} of the {len(jobs)} shards left")
    report.stage("converting shards", total=sum(p.source.nbytes for j in mine for p in j.plans))
    _run_jobs(source, mine, calibration, workers, report)
    return calibration


def _share_global_scales(source: SourceCheckpoint, plans: dict[str, list[TensorPlan]], partial: Path, workers: int,
                         report: Reporter, world: World) -> None:
    """NVFP4: one global scale per fused group (see `quantkit.convert.fp4`); rank 0 computes, every rank uses."""
    from quantkit.convert.fp4 import group_amax

    report.stage("NVFP4 global scales: amax per fused group")
    amax = on_main(world, lambda: group_amax(source, plans, partial, workers))
    for plan in (p for ps in plans.values() for p in ps):
        plan.group_amax = amax.get(plan.module)


def _finish(
    source: SourceCheckpoint, plans: dict[str, list[TensorPlan]], recipe: Recipe, identity: dict[str, Any],
    partial: Path, out: Path, force: bool, calibration: CalibrationResult | None,
) -> None:
    """Rank 0, once every shard is journaled: final shard names, metadata, card, publish."""
    journal = [read_journal(partial, i) for i in range(len(source.shard_files))]
    if calibration is not None and calibration.kv_scales:
        journal.append(_write_kv_scales(partial, calibration.kv_scales, source.adapter))
    weight_map = finalize_shards(partial, journal)
    _write_metadata(source, recipe, plans, partial, weight_map, calibration, identity)
    write_card(partial)  # README.md from quantkit.json; the source's README kept as README.source.md
    publish(partial, out, force)


@contextmanager
def _user_errors(partial: Path, needed: NeededBytes) -> Iterator[None]:
    """A full disk or an unwritable output becomes a one-line QuantkitError naming the path."""
    try:
        yield
    except OSError as exc:
        if is_no_space(exc):
            raise no_space_error(exc, partial, max(needed.total - tree_bytes(partial), 1)) from None
        if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            raise QuantkitError(f"{exc.filename or partial}: cannot write ({exc.strerror})") from None
        raise


def check_device(device: str) -> str:
    """A usable torch device string, or a one-line error (`cuda` asked for on a machine without one).

    `auto` is CUDA when this machine has a usable GPU, else the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
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


def _output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


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
def check_recipe_loadable(adapter: Adapter, recipe: Recipe) -> None:
    """Refuse a recipe that quantizes a role an engine builds unquantized (the output could not be served)."""
    if recipe.scheme == "nvfp4" and not recipe.calibration.dataset:  # W4A4: activation scales need data
        raise QuantkitError(f"recipe {recipe.name}: scheme nvfp4 (W4A4) needs calibration data for its activation "
                            "global scales (--calib FILE); use scheme nvfp4a16 for data-free")
    refused = unloadable_roles(adapter, recipe.quantize_roles)
    if refused:
        role, why = next(iter(refused.items()))
        raise QuantkitError(f"recipe {recipe.name}: quantize_roles has {role.value!r}, but {why}; "
                            "remove it from quantize_roles")
    if recipe.mixed:
        from quantkit.engines.mixed import check_plan_loadable

        check_plan_loadable(recipe, adapter)


def _write_kv_scales(partial: Path, kv_scales: dict[int, tuple[float, float]], adapter: Adapter) -> dict[str, Any]:
    """KV scales as one extra part file, under the names of `quantkit.engines.verdicts.kv_scale_names`, float32 [1]."""
    from quantkit.calibrate.kv import scale_tensors

    tensors = scale_tensors(kv_scales, adapter)
    name = part_name(_KV_SHARD_INDEX, 0)
    planned = [PlannedTensor(n, torch.float32, (1,)) for n in tensors]
    writer = StreamingShardWriter(partial / "parts" / name, planned, record_digest=True)
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
    identity: dict[str, Any],
) -> int:
    """config.json, index, recipe, carried-over files, reports and quantkit.json (last: it marks the
    metadata complete, see `is_finished`); returns output bytes."""
    copied, skipped = carry_over_files(source, partial)
    config = dict(source.config)
    ignore = source.adapter.ignore_patterns(set(recipe.quantize_roles))
    kv = calibration is not None and bool(calibration.kv_scales)
    precision = None
    if recipe.mixed:
        from quantkit.convert.precision import mixed_metadata

        config["quantization_config"], precision = mixed_metadata(source, recipe, plans, kv)
    elif recipe.fp4 is None:
        config["quantization_config"] = build_quantization_config(recipe.group_size, ignore, kv_cache=kv)
    else:
        config["quantization_config"] = build_fp4_quantization_config(recipe.scheme, ignore, kv_cache=kv)
    write_json_atomic(partial / "config.json", config)
    reports = calibration.write_reports(partial) if calibration is not None else []
    write_text_atomic(partial / RECIPE_FILE, recipe.to_yaml())
    shard_bytes = {f: (partial / f).stat().st_size for f in sorted(set(weight_map.values()))}
    write_json_atomic(partial / "model.safetensors.index.json",
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
        "tool_versions": identity["versions"],
        "source": {"name": source.root.name, "fingerprint": identity["fingerprint"], "format": source.source_format,
                   "bytes": source.source_bytes, "shards": len(source.shard_files), "warnings": source.warnings,
                   "hub": read_origin(source.root)},
        "recipe": identity["recipe"],
        "output": {"bytes": sum(shard_bytes.values()), "shards": shard_bytes, "files_copied": copied,
                   "files_skipped": skipped, "reports": reports},
        "summary": summary,
        "serving": serving_record(facts_from_checkpoint(config, weight_map, _kv_report(partial, reports)),
                                  _kv_speed(source.config, recipe, kv)),
        "tensors": tensors,
    }
    if precision is not None:  # per-unit plans only: a uniform recipe's quantkit.json is as it always was
        manifest["precision"] = precision
    write_json_atomic(partial / MANIFEST_FILE, manifest)
    return sum(shard_bytes.values())


def _kv_speed(config: dict[str, Any], recipe: Recipe, kv: bool) -> dict[str, Any] | None:
    """Both FP8 KV-scale options' modelled decode speed for the record (quantkit.plan.attention_plan)."""
    if not kv:
        return None
    from quantkit.plan.attention_plan import record_speed

    try:
        return record_speed(config, recipe.group_size)
    except (QuantkitError, KeyError, ValueError, TypeError):  # a config the planner cannot size: no speed figure
        return None


def _kv_report(partial: Path, reports: list[str]) -> dict[str, Any] | None:
    from quantkit.calibrate.result import KV_REPORT_FILE

    return json.loads((partial / KV_REPORT_FILE).read_text(encoding="utf-8")) if KV_REPORT_FILE in reports else None


def _data_bytes(partial: Path, shard_bytes: dict[str, int]) -> int:
    from quantkit.checkpoint.safetensors_header import read_header

    return sum(read_header(partial / f).data_bytes for f in shard_bytes)
