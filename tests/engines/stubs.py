"""Import stubs that let the engines' real loader code run on a CPU machine (no GPU, no compiled kernels).

Stubs replace imports only, never the logic under test (config parsing, scheme selection, ignore
matching, fusion decisions, load_weights routing, weight loaders). Every stub is listed here.

vLLM 0.33.0 (`install_vllm_stubs`):
- Compiled extensions (CUDA kernels built for torch 2.14 + CUDA; they cannot load here):
  `vllm._C_stable_libtorch`, `vllm._moe_C_stable_libtorch`, `vllm._qutlass_C`, `vllm.vllm_flash_attn`,
  `vllm.third_party.deep_gemm` (vendored DeepGEMM; the DSA indexer requires it to be importable)
  become empty placeholder modules.
- The custom-op namespaces those extensions register (`torch.ops._C`, `_moe_C`, `_C_cache_ops`,
  `_C_custom_ar`, `_qutlass_C`): every op exists and returns None, and each call is recorded
  (`KERNEL_CALLS`, reported by the runner). `torch.library.register_fake` is a no-op for those
  namespaces only (fake kernels exist only for torch.compile tracing).
- Platform probe: `vllm.platforms.current_platform` is `H200Platform`, vLLM's own `CudaPlatformBase`
  with the NVML/torch.cuda device queries answered as one H200 (SM 9.0, 141 GiB), so scheme and
  backend selection follow the Hopper path; its `device_type` is "cpu" so tensors are created on the CPU.
- CUDA runtime objects: `torch.cuda.Stream` / `torch.cuda.Event` are inert objects (vLLM creates an
  auxiliary stream for the MoE shared-expert overlap at construction); `torch.accelerator.empty_cache`
  is a no-op (the sparse-MLA workspace calls it when it grows).
- Model-class inspection runs in-process instead of in a child interpreter
  (`registry._run_in_subprocess`: vLLM forks only to keep CUDA uninitialised; the function is the same).
- Serving-side third-party packages the project venv lacks, imported at module level by modules on
  the import path (OpenAI server protocol, ZMQ engine IPC, structured output, multimodal media,
  metrics, request hashing/serialisation); none is used by config parsing or weight loading, and any
  placeholder instantiated after the stubs are installed is recorded (`PLACEHOLDER_USES`):
  aiohttp, cachetools, cbor2, cloudpickle, einops, fastapi, llguidance, msgspec, numba (Kimi's fused image
  preprocessing JIT), openai, openai_harmony, partial_json_parser, prometheus_client, pybase64, uvloop,
  xgrammar, zmq.

SGLang 0.5.23 (`install_sglang_stubs`):
- `sglang/__init__.py` is not run: it imports the frontend language (`sglang.lang`, its HTTP/OpenAI
  backends). The package is registered bare and the two runtime setup calls of that __init__ run
  (`redirect_third_party_caches`, `hf_transformers_patches.apply_all`).
- Compiled extensions: `sgl_kernel` (CUDA kernels; imported at module level by the W8A8 scheme, never
  called while loading), `tvm_ffi` (kernel FFI) become placeholder modules (`PLACEHOLDER_USES`).
- Platform probe: torch.cuda's device queries answer as one H200 (`is_available`, SM 9.0 capability,
  name, count, 141 GiB `mem_get_info`, no-op synchronize/empty_cache/memory stats) and
  `torch.version.cuda = "13.0"`, so `is_cuda()`, scheme and MoE-backend selection follow the Hopper
  path; `torch.cuda.Stream` / `Event` / `current_stream` are inert. A torch function mode makes every
  tensor asked for on "cuda" on the CPU instead (`.cuda()`, `pin_memory` are identities); thread-pool
  tasks run under the submitting thread's torch function modes (SGLang copies weights from a pool).
- Probe modules (absent compiled packages answering fixed values; any other attribute is a placeholder):
  `torchvision` (torch-ABI bound) has a version, so transformers' `AutoImageProcessor.register`, which
  sglang's multimodal configs call at import, accepts it; `deep_gemm` (SGLang's JIT FP8 GEMM, installed
  with SGLang on Hopper, so `ENABLE_JIT_DEEPGEMM` is on as on an H200) answers `get_num_sms()` = 132,
  which the DSA indexer reads at construction.
- Serving-side or compiled third-party packages the venv lacks, imported at module level on the import
  path, none used by config parsing or weight loading: IPython, gguf, pybase64, sentencepiece, zmq; aiohttp
  (the PD bootstrap HTTP server in `disaggregation/common/conn.py`; the decode-side handshake check the
  PD tests execute fetches the prefill's reply with `requests`, which is real).
  Pure-Python ones are installed for real instead (tests/engines/run_sglang.py lists them).
- Attention-backend runs only (`install_sglang_attention_stubs`, tests/engines/run_sglang_attn.py): `flash_mla`
  (FlashMLA's compiled kernels, imported at module level by `flashmla_backend.py`) becomes a placeholder
  module; the kernel functions the backends call are replaced by recorders in the runner itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["install_vllm_stubs", "install_sglang_stubs", "install_sglang_attention_stubs", "KERNEL_CALLS",
           "PLACEHOLDER_USES"]


# ---------------------------------------------------------------------------------------------------
# shared: placeholder modules for absent imports
# ---------------------------------------------------------------------------------------------------

PLACEHOLDER_USES: list[str] = []  # names of placeholder objects instantiated (should stay empty on load paths)


class _PlaceholderMeta(type):
    """Class-level behaviour module-level code needs: subscripting, `X | Y`, pydantic schemas."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder

    def __getitem__(cls, item: object) -> type:
        return cls

    def __or__(cls, other: object) -> type:
        return cls

    def __ror__(cls, other: object) -> type:
        return cls

    def __get_pydantic_core_schema__(cls, source: object, handler: object) -> object:
        from pydantic_core import core_schema

        return core_schema.any_schema()


class _Placeholder(metaclass=_PlaceholderMeta):
    """Any attribute of an absent module: can be subclassed, annotated with, and instantiated (recorded)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        caller = sys._getframe(1)
        PLACEHOLDER_USES.append(f"{caller.f_code.co_filename.rsplit('/', 2)[-1]}:{caller.f_lineno}")

    def __init_subclass__(cls, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        return _Placeholder()

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `_AbsentModule`s for the given packages and all their submodules."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name in self.names or any(name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AbsentModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


# ---------------------------------------------------------------------------------------------------
# vLLM
# ---------------------------------------------------------------------------------------------------

VLLM_COMPILED = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm._qutlass_C", "vllm.vllm_flash_attn",
                 "vllm.third_party.deep_gemm")
VLLM_ABSENT_PACKAGES = ("aiohttp", "cachetools", "cbor2", "cloudpickle", "einops", "fastapi", "llguidance", "msgspec",
                        "numba", "openai", "openai_harmony", "partial_json_parser", "prometheus_client", "pybase64",
                        "uvloop", "xgrammar", "zmq")
VLLM_OP_NAMESPACES = ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar", "_qutlass_C")
KERNEL_CALLS: list[str] = []  # "namespace.op" for every stubbed custom-op call


class _StubOp:
    """One custom op of a compiled extension (also its overloads, e.g. `.default`): a recorded no-op."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: object, **kwargs: object) -> None:
        KERNEL_CALLS.append(self._qualname)

    def __getattr__(self, overload: str) -> _StubOp:
        if overload.startswith("__"):
            raise AttributeError(overload)
        return self


class _KernelNamespace:
    """Stands in for `torch.ops.<ns>` of a compiled extension: every op exists, returns None, is recorded."""

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    def __getattr__(self, op: str) -> _StubOp:
        if op.startswith("__"):
            raise AttributeError(op)
        return _StubOp(f"{self._namespace}.{op}")


def _stub_custom_ops() -> None:
    import torch
    import torch.library

    for namespace in VLLM_OP_NAMESPACES:
        setattr(torch.ops, namespace, _KernelNamespace(namespace))
    real_register_fake = torch.library.register_fake

    def register_fake(op: object, *args: Any, **kwargs: Any) -> Any:
        if isinstance(op, str) and op.split("::")[0] in VLLM_OP_NAMESPACES:
            return None if args else (lambda fn: fn)
        return real_register_fake(op, *args, **kwargs)

    torch.library.register_fake = register_fake


class _CudaRuntimeObject:
    """`torch.cuda.Stream` / `torch.cuda.Event` on a CPU build: constructible, does nothing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _stub_cuda_runtime() -> None:
    import torch

    torch.cuda.Stream = _CudaRuntimeObject  # type: ignore[misc,assignment]
    torch.cuda.Event = _CudaRuntimeObject  # type: ignore[misc,assignment]
    torch.accelerator.empty_cache = lambda: None  # raises without an accelerator; frees nothing on the CPU


def _h200_platform(capability: tuple[int, int], total_memory: int) -> object:
    """vLLM's CUDA platform with the device queries answered as one Hopper GPU."""
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class H200Platform(CudaPlatformBase):
        device_type = "cpu"  # buffers vLLM allocates on `current_platform.device_type` land on the CPU

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return total_memory

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return 1

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132  # H200 SXM streaming multiprocessors

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0) -> int | None:
            return None

        @classmethod
        def get_all_device_numa_nodes(cls) -> list[int] | None:
            return None

    return H200Platform()


def install_vllm_stubs(capability: tuple[int, int] | None = None, total_memory: int = 141 * 2**30) -> None:
    """Install every vLLM stub listed in the module docstring (call before importing vLLM modules)."""
    sys.meta_path.insert(0, _AbsentFinder(VLLM_COMPILED + VLLM_ABSENT_PACKAGES))
    _stub_custom_ops()
    _stub_cuda_runtime()
    import vllm.platforms

    vllm.platforms._current_platform = _h200_platform(capability or H200_CAPABILITY, total_memory)  # type: ignore[arg-type]
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()


# ---------------------------------------------------------------------------------------------------
# SGLang
# ---------------------------------------------------------------------------------------------------

SGLANG_COMPILED = ("sgl_kernel", "tvm_ffi")
SGLANG_ABSENT_PACKAGES = ("IPython", "aiohttp", "gguf", "pybase64", "sentencepiece", "zmq")
# SM 9.0 (H200) unless QUANTKIT_ENGINE_SM says otherwise (e.g. "10.0": the Blackwell answers of scheme selection)
H200_CAPABILITY = tuple(int(x) for x in os.environ.get("QUANTKIT_ENGINE_SM", "9.0").split("."))[:2]
H200_MEMORY = (148_000_000_000, 150_754_820_096)  # torch.cuda.mem_get_info: (free, total) of one H200


H200_SMS = 132  # streaming multiprocessors of an H200 SXM


class _ProbeModule(types.ModuleType):
    """An absent package that answers a few probes with fixed values; every other attribute is a placeholder."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _ProbeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `_ProbeModule`s: package name -> the attributes it answers."""

    def __init__(self, probes: dict[str, dict[str, object]]) -> None:
        self.probes = probes

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.probes:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _ProbeModule(spec.name)
        module.__file__ = f"<{spec.name} probe>"
        for key, value in self.probes.get(spec.name, {}).items():
            setattr(module, key, value)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []


SGLANG_PROBES: dict[str, dict[str, object]] = {
    "torchvision": {"__version__": "0.28.0"},
    "deep_gemm": {"get_num_sms": lambda: H200_SMS},
}


def _cpu_device(device: object) -> object:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cuda_on_cpu_mode() -> object:
    """A torch function mode: tensors the engine asks for on "cuda" are made on the CPU, `.cuda()` and
    `.pin_memory()` are identities. Values and dtypes are untouched."""
    import torch
    from torch.overrides import TorchFunctionMode

    identities = {torch.Tensor.cuda, torch.Tensor.pin_memory}

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func in identities:
                return args[0]
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            if func is torch.Tensor.to and len(args) > 1:
                args = (args[0], *(_cpu_device(a) for a in args[1:]))
            return func(*args, **kwargs)

    return CudaOnCpu()


def _propagate_modes_to_threads() -> None:
    """Run ThreadPoolExecutor tasks under the submitting thread's torch function modes (they are
    thread-local; SGLang's loaders copy weights from a thread pool)."""
    import concurrent.futures
    import contextlib

    from torch.overrides import _get_current_function_mode_stack

    submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit_with_modes(self: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any,
                          **kwargs: Any) -> concurrent.futures.Future:
        modes = _get_current_function_mode_stack()

        def run() -> Any:
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                return fn(*args, **kwargs)

        return submit(self, run)

    concurrent.futures.ThreadPoolExecutor.submit = submit_with_modes  # type: ignore[method-assign]


def _h200_torch_cuda() -> None:
    """torch.cuda's device queries answered as one H200 (SM 9.0); nothing is ever launched on it."""
    import contextlib

    import torch

    cuda = torch.cuda
    cuda.is_available = lambda: True
    torch.version.cuda = "13.0"  # sglang.srt.utils.is_cuda(): is_available() and torch.version.cuda
    cuda.get_device_capability = lambda device=None: H200_CAPABILITY
    cuda.get_device_name = lambda device=None: "NVIDIA H200"
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.mem_get_info = lambda device=None: H200_MEMORY
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.current_stream = lambda device=None: _CudaRuntimeObject()
    cuda.default_stream = lambda device=None: _CudaRuntimeObject()
    cuda.stream = lambda stream=None: contextlib.nullcontext()


def _bare_sglang_package(src: str) -> None:
    """Register `sglang` without running its __init__ (the frontend language: sglang.lang, its HTTP
    backends); run the two setup calls that __init__ makes for the runtime."""
    package = types.ModuleType("sglang")
    package.__path__ = [f"{src}/sglang"]
    package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    package.__spec__.submodule_search_locations = package.__path__
    sys.modules["sglang"] = package
    from sglang.srt.environ import redirect_third_party_caches
    from sglang.srt.utils.hf_transformers_patches import apply_all

    redirect_third_party_caches()
    apply_all()


def install_sglang_stubs(src: str) -> None:
    """Install every SGLang stub listed in the module docstring; `src` holds the unpacked `sglang/`."""
    sys.meta_path.insert(0, _AbsentFinder(SGLANG_COMPILED + SGLANG_ABSENT_PACKAGES))
    sys.meta_path.insert(0, _ProbeFinder(SGLANG_PROBES))
    _h200_torch_cuda()
    _stub_cuda_runtime()
    _propagate_modes_to_threads()
    _cuda_on_cpu_mode().__enter__()
    _bare_sglang_package(src)


SGLANG_ATTENTION_COMPILED = ("flash_mla",)


def install_sglang_attention_stubs() -> None:
    """The extra compiled packages the MLA attention backends import at module level (after install_sglang_stubs)."""
    sys.meta_path.insert(0, _AbsentFinder(SGLANG_ATTENTION_COMPILED))
