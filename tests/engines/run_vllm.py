"""Run vLLM 0.33.0's real config and loader code on a checkpoint, on the CPU, and report what it did.

Usage (a fresh interpreter per checkpoint):
    python tests/engines/run_vllm.py CKPT_DIR [vLLM serve args, e.g. --kv-cache-dtype fp8] --out report.json
        [--no-draft]
    python tests/engines/run_vllm.py --batch JOBS.json   # [{"ckpt", "args", "out", "draft"}, ...]: vLLM is
        imported once and each job runs in a forked child (saves ~10 s of imports per checkpoint)

What runs for real (vLLM source unpacked from the PyPI wheel under .cache/engines/src/vllm, with
compressed-tensors 0.17.0 from .cache/engines/ct017 first on sys.path, as vLLM pins it):
`EngineArgs.add_cli_args` / `from_cli_args` / `create_engine_config` (the `vllm serve` path: ModelConfig,
CompressedTensorsConfig.from_config, CacheConfig, SpeculativeConfig for MTP), gloo single-rank
`init_distributed_environment` + `ensure_model_parallel_initialized`, `DefaultModelLoader.create_model`
(model construction, so `get_quant_method` / `get_moe_method` / `create_weights` per module) and
`DefaultModelLoader.load_weights` (the safetensors iterator, the model's `load_weights`,
`AutoWeightsLoader`, the parameters' weight loaders, `maybe_remap_kv_scale_name`), then the KV-cache
methods' `process_weights_after_loading` (what `_k_scale` / `_v_scale` the attention reads). The MTP
draft (added as `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'` when the config
has MTP layers, unless --no-draft) is built from vLLM's own SpeculativeConfig draft ModelConfig, with the
three `replace` steps of `SpecDecodeBaseProposer._create_draft_vllm_config` restated (that module imports
the GPU model runner), and loaded by the same DefaultModelLoader.
Not run: kernel post-processing (Marlin repacking: CUDA kernels), MLA's deferred post-load (W_UK/W_UV).
Only imports are stubbed (tests/engines/stubs.py); vLLM installs nothing extra (no deps-vllm).

Because vLLM does not report missing weights for quantized models, every parameter's weight loader is
wrapped and `unloaded_params` lists the parameters no loader call reached (KV-scale parameters, which
vLLM defaults by design, are reported under `kv` instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ENGINES = ROOT / ".cache" / "engines"
VLLM_SRC = ENGINES / "src" / "vllm"
CT017 = ENGINES / "ct017"
MTP_SPEC = {"method": "mtp", "num_speculative_tokens": 1}
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def _setup_paths() -> None:
    os.environ.setdefault("VLLM_CACHE_ROOT", str(ENGINES / "vllm-cache"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path[:0] = [str(CT017), str(VLLM_SRC), str(HERE)]


def _where(exc: BaseException) -> str:
    """The innermost vLLM (or compressed-tensors) frame of a traceback, as file:line function."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(ENGINES) in f.filename]
    if not frames:
        frames = traceback.extract_tb(exc.__traceback__)[-1:]
    if not frames:
        return "?"
    f = frames[-1]
    rel = f.filename.split("/src/vllm/")[-1].split("/ct017/")[-1]
    return f"{rel}:{f.lineno} {f.name}"


def _error(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:500]} ({_where(exc)})"


class LoadTracker:
    """Records which parameter every weight-loader call reaches and which checkpoint tensor fed it."""

    def __init__(self) -> None:
        self.loaded: set[int] = set()  # id() of parameters reached by a loader call
        self.yielded: list[str] = []
        self.consumed: set[str] = set()
        self._current: str | None = None

    def wrap_params(self, model: Any) -> dict[int, str]:
        """Wrap each parameter's weight_loader (params without one get vLLM's default, which the
        models' `getattr(param, "weight_loader", default_weight_loader)` would pick anyway)."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        names: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
            if getattr(param, "_qk_tracked", False):
                continue
            original = getattr(param, "weight_loader", default_weight_loader)
            param.weight_loader = self._recording(id(param), original)
            param._qk_tracked = True
        return names

    def _recording(self, key: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def weight_loader(*args: Any, **kwargs: Any) -> Any:
            self.loaded.add(key)
            if self._current is not None:
                self.consumed.add(self._current)
            return original(*args, **kwargs)

        return weight_loader

    def iterate(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            self.yielded.append(name)
            self._current = name
            yield name, tensor
        self._current = None


def _build_config(ckpt: Path, engine_args: list[str]) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace = parser.parse_args(["--model", str(ckpt), *engine_args])
    config = EngineArgs.from_cli_args(namespace).create_engine_config()
    config.load_config.device = "cpu"  # build the parameters on the CPU; everything else stays CUDA/SM90
    return config


def _init_distributed(config: Any, tmp: Path) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.v1.worker.workspace import init_workspace_manager

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp / 'dist-init'}")
        ensure_model_parallel_initialized(1, 1)
    # as gpu_worker._init_workspace_and_model_runner does before the model is built (sparse MLA uses it)
    init_workspace_manager(torch.device("cpu"), 2 if config.parallel_config.enable_dbo else 1)


def _quant_method_name(module: Any) -> str | None:
    """The quant method's class; for NVFP4 MoE also the backend vLLM's oracle picked (`:MARLIN` below SM100)."""
    method = getattr(module, "quant_method", None)
    if method is None:
        return None
    backend = getattr(method, "nvfp4_backend", None)
    return type(method).__name__ + (f":{backend.name}" if backend is not None else "")


def _moe_backends(model: Any) -> dict[str, dict[str, object]]:
    """Per MoE layer with a quantized method: the backend vLLM's oracle picked for it, and its bits / group."""
    out: dict[str, dict[str, object]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        backend = next((getattr(method, a) for a in ("wna16_backend", "fp8_backend", "nvfp4_backend")
                        if getattr(method, a, None) is not None), None)
        if backend is not None or hasattr(method, "wna16_backend") or hasattr(method, "fp8_backend"):
            out[name] = {"method": type(method).__name__, "backend": None if backend is None else backend.name,
                         "bits": getattr(method, "num_bits", None), "group": getattr(method, "group_size", None)}
    return out


def _survey(model: Any) -> tuple[dict[str, str], dict[str, dict[str, float | None]], dict[str, str]]:
    """(quant method per Linear/MoE/attention module, KV scales the attention reads, KV dtype per layer)."""
    from torch import nn
    from vllm.model_executor.layers.attention import Attention, MLAAttention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    surveyed = (LinearBase, VocabParallelEmbedding, Attention, MLAAttention, nn.Linear, nn.Embedding)
    methods: dict[str, str] = {}
    kv: dict[str, dict[str, float | None]] = {}
    kv_dtype: dict[str, str] = {}
    for name, module in model.named_modules():
        if hasattr(module, "quant_method") or isinstance(module, surveyed):
            method = _quant_method_name(module)
            methods[name] = method or ("torch.nn." + type(module).__name__ if type(module).__module__.startswith(
                "torch") else "none")
        if isinstance(module, (Attention, MLAAttention)):
            kv[name] = {"k_scale": _scalar(getattr(module, "_k_scale", None)),
                        "v_scale": _scalar(getattr(module, "_v_scale", None))}
            kv_dtype[name] = str(module.kv_cache_dtype)
    return methods, kv, kv_dtype


def _scalar(value: Any) -> float | None:
    if value is None:
        return None
    try:
        return float(value.reshape(-1)[0]) if hasattr(value, "reshape") else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _kv_post_load(model: Any) -> list[str]:
    """Run vLLM's own post-load step for the KV-cache methods (sets `_k_scale` / `_v_scale` from the
    loaded `k_scale` / `v_scale`); the Linear/MoE repacking needs CUDA kernels and is left out."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    done = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, BaseKVCacheMethod):
            method.process_weights_after_loading(module)
            done.append(name)
    return done


def _exempt(model: Any) -> set[int]:
    """Parameters vLLM itself does not expect from a checkpoint: KV-cache method scales (defaulted when
    absent) and empty placeholders; the same exemptions as `DefaultModelLoader.track_weights_loading`."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    out: set[int] = set()
    for _, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod):
            for _, p in module.named_parameters(recurse=False):
                out.add(id(p))
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel() == 0 or name.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "q_scale", "prob_scale"):
            out.add(id(p))
    return out


def load_section(config: Any, model_config: Any) -> dict[str, Any]:
    """Construct and load one model (target or draft) with vLLM's DefaultModelLoader."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    section: dict[str, Any] = {"error": None, "architecture": model_config.architectures[0],
                               "methods": {}, "skipped_tensors": [], "unloaded_params": [], "kv": {},
                               "kv_cache_dtype": None, "notes": {}}
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    loader = get_model_loader(config.load_config)
    tracker = LoadTracker()
    try:
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=model_config)
    except Exception as exc:  # construction failed: report it, nothing more to survey
        section["error"] = _error(exc)
        return section
    timings["construct_s"] = round(time.perf_counter() - t0, 3)
    section["model_class"] = type(model).__name__
    names = tracker.wrap_params(model)
    real_get_all_weights = loader.get_all_weights
    loader.get_all_weights = lambda mc, m: tracker.iterate(real_get_all_weights(mc, m))  # type: ignore[method-assign]
    t1 = time.perf_counter()
    import stubs

    uses_before, kernels_before = len(stubs.PLACEHOLDER_USES), len(stubs.KERNEL_CALLS)
    try:
        with set_current_vllm_config(config):
            loader.load_weights(model, model_config)
    except Exception as exc:
        section["error"] = _error(exc)
    # a stub reached while loading would make the load result meaningless: reported, asserted empty
    section["notes"]["stubs_used_in_load"] = sorted(set(stubs.PLACEHOLDER_USES[uses_before:])
                                                    | set(stubs.KERNEL_CALLS[kernels_before:]))
    timings["load_s"] = round(time.perf_counter() - t1, 3)
    exempt = _exempt(model)  # before the post-load step, which deletes the KV-scale parameters
    if section["error"] is None:
        try:
            section["notes"]["kv_post_load_modules"] = len(_kv_post_load(model))
        except Exception as exc:
            section["error"] = _error(exc)
    methods, kv, kv_dtype = _survey(model)
    section["methods"] = methods
    section["notes"]["moe_backends"] = _moe_backends(model)
    section["notes"]["linear_schemes"] = {n: type(m.scheme).__name__ for n, m in model.named_modules()
                                          if getattr(m, "scheme", None) is not None}
    section["kv"] = kv
    dtypes = sorted(set(kv_dtype.values()))
    section["kv_cache_dtype"] = dtypes[0] if len(dtypes) == 1 else (dtypes or None)
    section["skipped_tensors"] = [n for n in tracker.yielded if n not in tracker.consumed]
    unloaded = sorted(n for key, n in names.items() if key not in tracker.loaded and key not in exempt)
    # Kimi K2.5's vision tower is built from the config's vision_config; a synthetic wrapper carries no
    # real vision weights, so its parameters are listed apart (the language model is what is under test)
    vision = [n for n in unloaded if n.startswith(VISION_PREFIXES)]
    section["unloaded_params"] = [n for n in unloaded if n not in vision]
    if vision:
        section["notes"]["unloaded_vision_params"] = len(vision)
    section["notes"]["checkpoint_tensors_read"] = len(tracker.yielded)
    section["notes"]["kv_scale_params"] = sorted(
        n for key, n in names.items() if key in exempt and n.rsplit(".", 1)[-1].endswith("_scale"))
    section["notes"]["timings"] = timings
    section["_model"] = model
    return section


def _mtp_layers(hf_config: Any) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(text, "num_nextn_predict_layers", 0) or 0)


def _draft_config(config: Any) -> Any:
    """The draft VllmConfig as `SpecDecodeBaseProposer._create_draft_vllm_config` builds it (that module
    imports the GPU model runner, so its three `replace` steps are restated here)."""
    from vllm.config import replace

    spec = config.speculative_config
    base = config
    if spec.moe_backend is not None:
        base = replace(base, kernel_config=replace(base.kernel_config, moe_backend=spec.moe_backend))
    base = replace(base, attention_config=replace(base.attention_config, backend=spec.attention_backend))
    if spec.kv_cache_dtype is not None:
        base = replace(base, cache_config=replace(base.cache_config, cache_dtype=spec.kv_cache_dtype))
    return base


def _vllm_notes(config: Any, target: Any) -> dict[str, Any]:
    """Engine-specific decisions worth asserting on."""
    notes: dict[str, Any] = {"quantization": config.model_config.quantization,
                             "cache_dtype": config.cache_config.cache_dtype,
                             "quant_config": type(config.quant_config).__name__ if config.quant_config else None}
    qc = config.quant_config
    if qc is not None and hasattr(qc, "kv_cache_scheme"):
        notes["kv_cache_scheme"] = qc.kv_cache_scheme
        notes["ignore"] = list(getattr(qc, "ignore", []))
    hf = config.model_config.hf_text_config
    for key in ("index_topk_freq", "index_topk_pattern", "index_topk", "num_nextn_predict_layers"):
        if hasattr(hf, key):
            notes[key] = getattr(hf, key)
    if target is not None:
        notes["indexer_layers"] = sorted({int(n.split(".layers.")[1].split(".")[0]) for n, _ in target.named_modules()
                                          if n.endswith(".indexer") and ".layers." in n})
    return notes


_PREPARED: list[Any] = []
# imported once by `prepare` so that batch children (forked) start with them loaded
_PRELOAD = ("vllm.engine.arg_utils", "vllm.model_executor.model_loader", "vllm.model_executor.models.deepseek_v2",
            "vllm.model_executor.models.deepseek_mtp", "vllm.model_executor.models.glm4_moe",
            "vllm.model_executor.models.glm4_moe_mtp", "vllm.model_executor.models.kimi_k25",
            "vllm.models.deepseek_v32")


def prepare(preload: bool = False) -> Any:
    """sys.path + stubs (once per process); with `preload`, import the modules every run needs."""
    if not _PREPARED:
        _setup_paths()
        import stubs

        stubs.install_vllm_stubs()
        _PREPARED.append(stubs)
    if preload:
        import importlib

        for name in _PRELOAD:
            importlib.import_module(name)
    return _PREPARED[0]


def run_batch(jobs: list[dict[str, Any]]) -> int:
    """Import vLLM once, then run each job {"ckpt", "args", "out", "draft"} in a forked child: every run
    starts from the same freshly imported state (no config, distributed or registry state carried over)."""
    prepare(preload=True)
    from forked import run_forked

    def run_job(job: dict[str, Any]) -> dict[str, Any]:
        args = list(job.get("args", []))
        draft = job.get("draft", True) and "--no-draft" not in args
        return run(Path(job["ckpt"]).resolve(), [a for a in args if a != "--no-draft"], draft=draft)

    return run_forked(jobs, run_job)


def run(ckpt: Path, engine_args: list[str], draft: bool) -> dict[str, Any]:
    import tempfile

    started = time.perf_counter()
    stubs = prepare()
    import vllm

    report: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__, "args": list(engine_args),
                              "error": None, "architecture": None, "methods": {}, "skipped_tensors": [],
                              "unloaded_params": [], "kv": {}, "kv_cache_dtype": None, "notes": {}}
    cfg_json = json.loads((ckpt / "config.json").read_text())
    has_mtp = int((cfg_json.get("text_config") or cfg_json).get("num_nextn_predict_layers", 0) or 0) > 0
    args = list(engine_args)
    if draft and has_mtp and "--speculative-config" not in args:
        args += ["--speculative-config", json.dumps(MTP_SPEC)]
    report["notes"]["effective_args"] = args
    report["notes"]["import_s"] = round(time.perf_counter() - started, 3)
    try:
        config = _build_config(ckpt, args)
    except Exception as exc:
        if args == engine_args:
            report["error"] = _error(exc)
            report["notes"]["wall_s"] = round(time.perf_counter() - started, 3)
            return report
        # the MTP speculative config we added is refused: that is the draft's verdict; load the target alone
        report["draft"] = {"error": _error(exc), "architecture": None, "methods": {}, "skipped_tensors": [],
                           "unloaded_params": [], "kv": {}, "kv_cache_dtype": None, "notes": {}}
        report["notes"]["effective_args"] = args = list(engine_args)
        try:
            config = _build_config(ckpt, args)
        except Exception as exc2:
            report["error"] = _error(exc2)
            report["notes"]["wall_s"] = round(time.perf_counter() - started, 3)
            return report
    report["notes"]["config_s"] = round(time.perf_counter() - started, 3)
    report["architecture"] = config.model_config.architectures[0]
    with tempfile.TemporaryDirectory() as tmp:
        _init_distributed(config, Path(tmp))
        target = load_section(config, config.model_config)
        model = target.pop("_model", None)
        report.update({k: v for k, v in target.items() if k != "notes"})
        report["notes"].update(target["notes"])
        report["notes"].update(_vllm_notes(config, model))
        if draft and config.speculative_config is not None:
            spec = config.speculative_config
            draft_cfg = _draft_config(config)
            section = load_section(draft_cfg, spec.draft_model_config)
            section.pop("_model", None)
            # the proposer replaces each MTP layer's shared_head.head with the target's lm_head after load
            # (`SpecDecodeBaseProposer._maybe_share_lm_head`), so those parameters need no checkpoint data
            shared = [n for n in section["unloaded_params"] if n.endswith("shared_head.head.weight")]
            section["unloaded_params"] = [n for n in section["unloaded_params"] if n not in shared]
            section["notes"]["lm_head_shared_from_target"] = shared
            section["notes"]["method"] = spec.method
            report["draft"] = section
            both = set(section["skipped_tensors"])
            report["skipped_tensors"] = [n for n in report["skipped_tensors"] if n in both]
            report["notes"]["target_skipped_tensors"] = len(target["skipped_tensors"])  # the MTP layer's
    import compressed_tensors

    report["notes"]["compressed_tensors"] = compressed_tensors.__version__
    report["notes"]["kernel_calls"] = sorted(set(stubs.KERNEL_CALLS))
    report["notes"]["placeholder_uses"] = sorted(set(stubs.PLACEHOLDER_USES))
    report["notes"]["wall_s"] = round(time.perf_counter() - started, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path, nargs="?")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-draft", action="store_true", help="do not build the MTP draft model")
    parser.add_argument("--batch", type=Path, help='JSON list of {"ckpt", "args", "out", "draft"} jobs')
    known, engine_args = parser.parse_known_args(argv)
    if known.batch is not None:
        return run_batch(json.loads(known.batch.read_text()))
    if known.ckpt is None or known.out is None:
        parser.error("CKPT and --out are required (or --batch JOBS.json)")
    report = run(known.ckpt.resolve(), engine_args, draft=not known.no_draft)
    known.out.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
