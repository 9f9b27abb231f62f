"""Execute SGLang 0.5.23's own loader on a checkpoint, on the CPU, and write what it did as JSON.

    python tests/engines/run_sglang.py CKPT_DIR [SGLANG SERVER ARGS...] --out report.json
    python tests/engines/run_sglang.py --batch JOBS.json   # [{"ckpt", "args", "out"}, ...]: SGLang is
        imported once and each job runs in a forked child (saves the ~8 s of imports per run)

Runs in a fresh interpreter (the harness starts it): SGLang's sources are the unpacked wheel under
`.cache/engines/src/sglang`, the stubs of `tests/engines/stubs.py` replace only GPU kernels, compiled
extensions and platform probes. What runs for real, as `sglang serve` would for these args at tp=1:
`prepare_server_args` (SGLang's argparse and resolution pipeline), `publish`, `initialize_moe_config`,
single-rank gloo `init_distributed_environment` / `initialize_model_parallel`, `ModelConfig.from_server_args`,
`build_load_config`, `_get_quantization_config` (compressed-tensors parsing, `kv_cache_scheme`),
`_initialize_model` (`resolve_shared_experts_config` with the model's `shared_experts_fusion_disable_reason`,
the model's constructor, hence `get_quant_method` / `get_linear_scheme` / `get_moe_scheme` per module and
their `create_weights`), `DefaultModelLoader.load_weights_only` over `_get_all_weights` (the model's own
`load_weights` and weight loaders), the KV-cache methods' `process_weights_after_loading` (the scale the
attention reads), `configure_kv_cache_dtype` and `load_kv_cache_scales`. With MTP layers in the checkpoint
the NextN draft is then built and loaded the way the speculative worker does for `--speculative-algorithm
NEXTN` (draft `ModelConfig`, speculative MoE contexts, target embedding and head shared into the draft).
Not run: `process_weights_after_loading` of weight methods (Marlin repacking needs the GPU kernels).

Observation only, no engine logic replaced: a torch function mode records, per tensor storage, which
checkpoint tensors its data came from (through views, casts, concatenation, dequantisation, copies), so
the report says which checkpoint tensors reached no parameter and which parameters received nothing;
each parameter's first-dimension slices are compared before/after loading to find slots left unwritten
(e.g. a fused shared-expert slot). Not counted as unloaded: parameters SGLang marks `_skip_weight_check`
and KV-scale parameters (optional: the KV method defaults them), and the WNA16 MoE `g_idx` / sort indices
without group act-order (the engine replaces them). `kv` lists the attention modules that write the KV
cache (MLA's prefill `attn_mha` never does; its scales are in `notes.kv_no_cache_attention`).

Third-party modules installed for real in `.cache/engines/deps-sglang` (`pip install --no-deps --target`):
msgspec==0.23.0, orjson==3.13.0 (SGLang's config records and their JSON fields), openai==2.8.0,
distro==1.9.0, sniffio==1.3.1 (OpenAI protocol types, imported at module level),
partial_json_parser==0.2.1.1.post7, einops==0.8.1, starlette==0.50.0.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module
from torch.overrides import TorchFunctionMode

Section = dict[str, Any]  # one JSON report section
SGLangObject = Any  # a ServerArgs / ModelConfig / LoadConfig / quant config: SGLang is importable only after the stubs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENGINES = REPO / ".cache" / "engines"
SRC = ENGINES / "src" / "sglang"
DEPS = ENGINES / "deps-sglang"

# architecture -> the SGLang model modules that define it and its NextN draft (imported alone: SGLang's
# registry would otherwise import every model module, ~20 s)
MODEL_MODULES: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": ("deepseek_v2", "deepseek_nextn"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek_nextn"),
    "GlmMoeDsaForCausalLM": ("glm4_moe",),
    "Glm4MoeForCausalLM": ("glm4_moe", "glm4_moe_nextn"),
    "KimiK25ForConditionalGeneration": ("kimi_k25",),
}
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale")
# Attention modules that never write the KV cache, so their scales are not the cache's: MLA's prefill MHA
# (every call in models/deepseek_common/attention_forward_methods/forward_mha.py passes save_kv_cache=False).
NO_CACHE_ATTENTION = (".attn_mha",)


# ---- process setup ---------------------------------------------------------------------------------
_PREPARED: set[str] = set()  # architectures whose model modules are importable in this process
# imported once by `prepare(preload=True)` so that batch children (forked) start with them loaded
_PRELOAD = ("sglang.srt.server_args", "sglang.srt.runtime_context", "sglang.srt.configs.model_config",
            "sglang.srt.model_loader.loader", "sglang.srt.models.registry", "sglang.srt.mem_cache.kv_cache_dtype",
            "sglang.srt.model_executor.model_runner_components.load_model_utils",
            "sglang.srt.distributed.parallel_state")


def prepare(architectures: Iterable[str], preload: bool = False) -> None:
    """sys.path, SGLang's model registry limited to these architectures' modules, the stubs (once per
    process); with `preload`, import what every run needs."""
    if not _PREPARED:
        sys.path[:0] = [str(SRC), str(DEPS), str(HERE)]
        package = Path(tempfile.mkdtemp(prefix="sglang-models-")) / "quantkit_sglang_models"
        package.mkdir()
        (package / "__init__.py").write_text("")
        for name in sorted({m for a in architectures for m in MODEL_MODULES.get(a, ())}):
            (package / f"{name}.py").write_text(f"from sglang.srt.models.{name} import EntryClass  # noqa: F401\n")
        sys.path.insert(0, str(package.parent))
        # SGLang's registry hook for out-of-tree models: register only these modules
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = package.name
        from stubs import install_sglang_stubs

        install_sglang_stubs(str(SRC))
        _PREPARED.update(architectures)
    if preload:
        import importlib

        for name in _PRELOAD:
            importlib.import_module(name)


def _init_single_rank() -> None:
    import socket

    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(backend="gloo")


def _publish(ckpt: Path, args: list[str]) -> SGLangObject:
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", str(ckpt), *args])
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    initialize_moe_config()
    return server_args


def kv_cache_of(server_args: SGLangObject) -> tuple[SGLangObject, SGLangObject, str, torch.dtype]:
    """What ModelRunner resolves for the published args: (model config, quant config, the `kv_cache_dtype_str`
    it advertises to a PD peer, the KV torch dtype), through SGLang's `_get_quantization_config` and
    `configure_kv_cache_dtype`."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import _get_quantization_config
    from sglang.srt.runtime_context import get_model

    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(server_args=server_args, tp_rank=0,
                                    remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode=get_model().weight_cache_mode, weight_cache_socket=None)
    quant_config = _get_quantization_config(model_config, load_config)
    resolved, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=SimpleNamespace(quant_config=quant_config),
        model_dtype=model_config.dtype, is_draft_worker=False, is_dflash=False,
        speculative_draft_attention_backend=None)
    return model_config, quant_config, resolved if resolved is not None else get_model().kv_cache_dtype, dtype


# ---- observation ----------------------------------------------------------------------------------
def _flat_tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat_tensors(item)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


class Provenance(TorchFunctionMode):
    """Torch function mode: tensor storage -> names of the checkpoint tensors its data came from."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, set[str]] = {}
        self.numbers: dict[int, tuple[object, set[str]]] = {}  # thread -> last number read from a tensor

    def tag(self, tensor: torch.Tensor, name: str) -> None:
        key = _storage_key(tensor)
        if key is not None:
            self.sources[key] = {name}

    def of(self, tensor: torch.Tensor) -> set[str]:
        return self.sources.get(_storage_key(tensor) or 0, set())

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [_storage_key(t) for t in _flat_tensors((args, kwargs))]
        came_from = set().union(*(self.sources.get(k, set()) for k in inputs if k is not None))
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist"):  # a Python number that may be written back (`fill_(w.item())`)
            self.numbers[threading.get_ident()] = (out, came_from)
            return out
        number, number_from = self.numbers.get(threading.get_ident(), (None, set()))
        if number is not None and any(a is number or a == number for a in args[1:] if not hasattr(a, "shape")):
            came_from = came_from | number_from
        if name.endswith("_") and not name.endswith("__") or name == "__setitem__" or "out" in kwargs:
            target = kwargs.get("out", args[0] if args else None)
            key = _storage_key(target) if isinstance(target, torch.Tensor) else None
            if key is not None and came_from:
                self.sources.setdefault(key, set()).update(came_from)
            return out
        for tensor in _flat_tensors(out):
            key = _storage_key(tensor)
            if key is None:
                continue
            if key in inputs:  # a view or an alias
                if came_from:
                    self.sources.setdefault(key, set()).update(came_from)
            elif came_from:
                self.sources[key] = set(came_from)
            else:  # a fresh allocation (an address can be reused)
                self.sources.pop(key, None)
        return out


def _tagged(weights: Iterable[tuple[str, torch.Tensor]], provenance: Provenance,
            seen: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        provenance.tag(tensor, name)
        seen.append(name)
        yield name, tensor


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _unwritten_slices(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """First-dimension slices whose every element is as it was before loading."""
    if before.dim() < 2 or before.shape != after.shape or before.dtype != after.dtype:
        return []
    same = (before == after) | (before.isnan() & after.isnan()) if before.is_floating_point() else before == after
    rows = same.flatten(1).all(dim=1)
    return [i for i, r in enumerate(rows.tolist()) if r] if not bool(rows.all()) else []


# ---- one model ------------------------------------------------------------------------------------
def _methods(model: Module) -> dict[str, str | None]:
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.radix_attention import RadixAttention

    out: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (LinearBase, FusedMoE, RadixAttention)):
            continue
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None)
        label = None if method is None else type(method).__name__
        if scheme is not None:
            label = f"{label}:{type(scheme).__name__}"
        out[name] = label
    return out


def _kv(model: Module, cache_writers: bool = True) -> dict[str, dict[str, float | None]]:
    """The scales each RadixAttention reads (`k_scale_float`), for the cache-writing ones or the others."""
    from sglang.srt.layers.radix_attention import RadixAttention

    out: dict[str, dict[str, float | None]] = {}
    for name, module in model.named_modules():
        if isinstance(module, RadixAttention) and name.endswith(NO_CACHE_ATTENTION) != cache_writers:
            out[name] = {"k_scale": module.k_scale_float, "v_scale": module.v_scale_float}
    return out


def _process_kv_methods(model: Module) -> None:
    """What DefaultModelLoader.postprocess_weights does, for the KV-cache methods only."""
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, BaseKVCacheMethod):
            method.process_weights_after_loading(module)


def _moe_notes(model: Module, quant_config: SGLangObject) -> dict[str, object]:
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    notes: dict[str, object] = {"moe_runner_backend": str(get_moe_runner_backend().value),
                                "moe_runners": _moe_runners(model)}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and quant_config is not None and hasattr(quant_config, "get_scheme_dict"):
            scheme = quant_config.get_scheme_dict(module, f"{name}.0.gate_proj")
            weights = (scheme or {}).get("weights")
            if weights is not None:
                notes["group_size"] = weights.group_size
                notes["triton_wna16_moe_supported_for_group"] = quant_config._is_wna16_triton_moe_supported(weights)
            break
    return notes


def _moe_runners(model: Module) -> dict[str, dict[str, object]]:
    """Per MoE layer with a quantized scheme: the runner backend that scheme built (None: it built none, so its
    forward would fail: `CompressedTensorsW8A8Fp8MoE` under `--moe-runner-backend marlin`), and its bits / group."""
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    out: dict[str, dict[str, object]] = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        if isinstance(module, FusedMoE) and scheme is not None:
            runner = getattr(scheme, "runner", None)
            out[name] = {"scheme": type(scheme).__name__,
                         "runner": None if runner is None else str(runner.runner_backend.value),
                         "bits": getattr(scheme, "num_bits", None), "group": getattr(scheme, "group_size", None)}
    return out


def _engine_computed(model: Module) -> set[str]:
    """Parameters the engine fills itself: the WNA16 MoE `g_idx` / sort indices without group act-order
    (compressed_tensors_wNa16_moe.py: process_weights_after_loading replaces them with empty tensors)."""
    names = set()
    for prefix, module in model.named_modules():
        scheme = getattr(module, "scheme", None)
        if scheme is not None and getattr(scheme, "actorder", None) != "group":
            names |= {f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False) if "g_idx" in n}
    return names


def _load_one(model_config: SGLangObject, load_config: SGLangObject, provenance: Provenance,
              target: Module | None) -> tuple[Section, Module | None]:
    """Build and load one model (target, or the draft when `target` is given); the report section."""
    import torch
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
        get_model_loader,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models.registry import ModelRegistry

    section: Section = {"architecture": model_config.hf_config.architectures[0], "error": None,
                               "methods": {}, "skipped_tensors": [], "unloaded_params": [], "kv": {}, "notes": {}}
    stage = "construction"
    model = None
    try:
        model_class, _ = ModelRegistry.resolve_model_cls(model_config.hf_config.architectures)
        loader = get_model_loader(load_config=load_config, model_config=model_config)
        quant_config = _get_quantization_config(model_config, load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, quant_config)
        gate = getattr(model_class, "shared_experts_fusion_disable_reason", None)
        section["notes"].update({
            "model_class": f"{model_class.__module__}.{model_class.__name__}",
            "quant_config": None if quant_config is None else type(quant_config).__name__,
            "kv_cache_quant_algo": getattr(quant_config, "kv_cache_quant_algo", None),
            "shared_experts_fusion": model.shared_experts_config.num_fused_shared_experts > 0,
            "shared_experts_fusion_disable_reason": gate(model_config.hf_config, quant_config) if gate else None,
        })
        section["notes"].update(_moe_notes(model, quant_config))
        section["methods"] = _methods(model)
        before = _snapshot(model)
        seen: list[str] = []
        stage = "load_weights"
        with provenance, set_default_torch_dtype(model_config.dtype):
            weights = _tagged(loader._get_all_weights(model_config, model), provenance, seen)
            DefaultModelLoader.load_weights_only(model, weights, torch.device("cpu"))
            if target is not None:  # the speculative worker shares the target's embedding and head
                embed, head = target.get_embed_and_head()
                model.set_embed_and_head(embed, head)
        landed: set[str] = set()
        unloaded, unwritten = [], {}
        computed = _engine_computed(model)
        for name, param in model.named_parameters():
            came_from = provenance.of(param)
            landed |= came_from
            if not came_from:
                optional = getattr(param, "_skip_weight_check", False) or name.endswith(KV_SCALE_SUFFIXES)
                if not optional and name not in computed:
                    unloaded.append(name)
                continue
            slots = _unwritten_slices(before[name], param.detach())
            if slots:
                unloaded.append(name)
                unwritten[name] = slots
        section["skipped_tensors"] = sorted(set(seen) - landed)
        section["unloaded_params"] = sorted(unloaded)
        section["notes"]["unwritten_slices"] = unwritten
        stage = "kv scales"
        _process_kv_methods(model)
        section["kv"] = _kv(model)
        section["notes"]["kv_no_cache_attention"] = _kv(model, cache_writers=False)
    except Exception as exc:  # the engine raised: that is the finding
        frames = traceback.extract_tb(exc.__traceback__)
        frame = ([f for f in frames if str(SRC) in f.filename] or frames)[-1]  # the innermost SGLang frame
        where = f"{frame.filename.split('/sglang/')[-1]}:{frame.lineno} {frame.name}"
        section["error"] = f"{type(exc).__name__}: {exc} ({stage}; {where})"
        section["notes"]["traceback"] = traceback.format_exc()[-4000:]
    return section, model


def _kv_cache_dtype(model: Module, model_config: SGLangObject, is_draft: bool) -> str:
    """The KV cache dtype as ModelRunner.configure_kv_cache_dtype resolves it for these args."""
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.runtime_context import get_model, get_spec

    resolved, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype, model=model, model_dtype=model_config.dtype,
        is_draft_worker=is_draft, is_dflash=False, speculative_draft_attention_backend=None,
        speculative_draft_kv_cache_dtype=get_spec().speculative_draft_kv_cache_dtype)
    if resolved is not None:
        return resolved
    requested = get_model().kv_cache_dtype  # ModelRunner.kv_cache_dtype_str; for "auto" the model dtype
    return requested if requested != "auto" else str(dtype).removeprefix("torch.")


def _run_target(server_args: SGLangObject, provenance: Provenance) -> tuple[Section, Module | None]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        build_load_config,
        load_kv_cache_scales,
    )
    from sglang.srt.runtime_context import get_model

    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(server_args=server_args, tp_rank=0,
                                    remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode=get_model().weight_cache_mode, weight_cache_socket=None)
    section, model = _load_one(model_config, load_config, provenance, None)
    if model is not None and section["error"] is None:
        section["kv_cache_dtype"] = _kv_cache_dtype(model, model_config, False)
        try:
            load_kv_cache_scales(model=model, kv_cache_dtype=get_model().kv_cache_dtype)  # as ModelRunner.load_model
        except RuntimeError as exc:
            section["error"] = f"RuntimeError: {exc} (load_kv_cache_scales)"
    return section, model


def _run_draft(server_args: SGLangObject, provenance: Provenance, target: Module, target_architecture: str) -> Section:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.utils import speculative_moe_a2a_backend_context, speculative_moe_backend_context
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.runtime_context import get_model, get_spec

    model_config = ModelConfig.from_server_args(server_args, model_path=get_spec().speculative_draft_model_path,
                                                model_revision=get_spec().speculative_draft_model_revision,
                                                is_draft_model=True)
    load_config = build_load_config(server_args=server_args, tp_rank=0,
                                    remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode=get_model().weight_cache_mode, weight_cache_socket=None)
    architecture = model_config.hf_config.architectures[0]
    if architecture == target_architecture:
        return {"architecture": architecture, "error": f"no NextN draft class for {architecture}: the draft "
                "model would be the target itself", "methods": {}, "skipped_tensors": [], "unloaded_params": [],
                "kv": {}, "kv_cache_dtype": None, "notes": {}}
    with speculative_moe_backend_context(), speculative_moe_a2a_backend_context():
        section, model = _load_one(model_config, load_config, provenance, target)
    if model is not None and section["error"] is None:
        section["kv_cache_dtype"] = _kv_cache_dtype(model, model_config, True)
    return section


def run(ckpt: Path, args: list[str]) -> Section:
    """Everything for one checkpoint and one set of server args; the JSON report."""
    started = time.perf_counter()
    config = json.loads((ckpt / "config.json").read_text())
    architecture = config["architectures"][0]
    prepare([architecture])
    report: Section = {"engine": "sglang", "version": _version(), "args": list(args),
                              "architecture": architecture}
    try:
        server_args = _publish(ckpt, args)
        _init_single_rank()
    except Exception as exc:
        report.update(error=f"{type(exc).__name__}: {exc} (server args)", methods={}, skipped_tensors=[],
                      unloaded_params=[], kv={}, kv_cache_dtype=None, notes={"traceback": traceback.format_exc()})
        return report
    provenance = Provenance()
    timings = {"setup": round(time.perf_counter() - started, 2)}
    section, target = _run_target(server_args, provenance)
    timings["target"] = round(time.perf_counter() - started - timings["setup"], 2)
    report.update(section)
    report.setdefault("kv_cache_dtype", None)
    text = config.get("text_config", config)
    report["draft"] = None
    if int(text.get("num_nextn_predict_layers") or 0) > 0 and target is not None:
        report["draft"] = _draft_section(ckpt, args, provenance, target, architecture)
    report["notes"]["placeholder_uses"] = _placeholder_uses()
    report["notes"]["wall_s"] = round(time.perf_counter() - started, 2)
    report["notes"]["timings_s"] = dict(timings, draft=round(report["notes"]["wall_s"] - sum(timings.values()), 2))
    return report


def _draft_section(ckpt: Path, args: list[str], provenance: Provenance, target: Module, architecture: str) -> Section:
    """The NextN draft as `--speculative-algorithm NEXTN` loads it (added to the args if absent)."""
    draft_args = list(args)
    if "--speculative-algorithm" not in draft_args:
        draft_args += ["--speculative-algorithm", "NEXTN"]
        server_args = _publish(ckpt, draft_args)
    else:
        from sglang.srt.runtime_context import get_server_args

        server_args = get_server_args()
    section = _run_draft(server_args, provenance, target, architecture)
    section["args"] = draft_args
    return section


def _version() -> str:
    from sglang.version import __version__

    return __version__


def _placeholder_uses() -> list[str]:
    from stubs import PLACEHOLDER_USES

    return sorted(set(PLACEHOLDER_USES))


def run_batch(jobs: list[dict[str, Any]]) -> int:
    """Import SGLang once, then run each job {"ckpt", "args", "out"} in a forked child: every run starts from
    the same freshly imported state (no server args, distributed or MoE state carried over)."""
    prepare([json.loads((Path(j["ckpt"]) / "config.json").read_text())["architectures"][0] for j in jobs],
            preload=True)
    from forked import run_forked

    return run_forked(jobs, lambda job: run(Path(job["ckpt"]), list(job.get("args", []))))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--batch"] and len(argv) == 2:
        return run_batch(json.loads(Path(argv[1]).read_text()))
    if "--out" not in argv or len(argv) < 3:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    i = argv.index("--out")
    out = Path(argv[i + 1])
    rest = argv[:i] + argv[i + 2:]
    report = run(Path(rest[0]), rest[1:])
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
