"""Finding SGLang for the integrity campaign (``quantkit simulate integrity --engine sglang``).

Order: an importable ``sglang`` (a real installation, e.g. a GPU serving box) is used as is. Otherwise the SGLang
source tree given by ``--sglang-src`` / ``QUANTKIT_SGLANG_SRC``, default ``<repo>/.cache/engines/src/sglang`` (the
unpacked 0.5.23 wheel ``make engines`` fetches), is put on ``sys.path`` with its pure-Python deps
(``.cache/engines/deps-sglang``). On a machine without CUDA the repository's engine stubs
(``tests/engines/stubs.py``, the one place that lists what is replaced: GPU kernels, compiled extensions and
platform probes only) are installed first, exactly as the engine tests do. The process then publishes SGLang's
own ``ServerArgs`` (torch-native attention, a 2-layer toy config written to a temporary directory) so the
scheduler's bookkeeping (``ScheduleBatch``, allocation, radix cache) can run; no model is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from quantkit.core.errors import QuantkitError

__all__ = ["SRC_ENV", "default_src", "load_sglang"]

SRC_ENV = "QUANTKIT_SGLANG_SRC"
REPO = Path(__file__).resolve().parents[3]
_TOY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
               "vocab_size": 32000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
_LOADED: dict[str, str] = {}


def default_src() -> Path:
    return Path(os.environ.get(SRC_ENV) or REPO / ".cache" / "engines" / "src" / "sglang")


def _version() -> str:
    from sglang.version import __version__

    return str(__version__)


def load_sglang(src: str | os.PathLike[str] | None = None) -> str:
    """Make SGLang's runtime importable in this process (once) and publish toy server args; its version."""
    if "version" in _LOADED:
        return _LOADED["version"]
    if "sglang" not in sys.modules and importlib.util.find_spec("sglang") is None:
        root = Path(src) if src else default_src()
        if not (root / "sglang" / "srt").is_dir():
            raise QuantkitError(f"{root}: no SGLang source tree (sglang/srt) here; run `make engines`, or pass "
                                f"--sglang-src / set {SRC_ENV}")  # fmt: skip
        deps = root.parent.parent / "deps-sglang"
        sys.path[:0] = [str(root), str(deps)]
        import torch

        if not torch.cuda.is_available():
            _install_stubs(root)
    _publish()
    _LOADED["version"] = _version()
    return _LOADED["version"]


def _install_stubs(root: Path) -> None:
    stubs = REPO / "tests" / "engines" / "stubs.py"
    if not stubs.is_file():
        raise QuantkitError(f"{stubs}: missing; SGLang without CUDA needs the repository's engine stubs")
    spec = importlib.util.spec_from_file_location("quantkit_engine_stubs", stubs)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.install_sglang_stubs(str(root))


def _publish() -> None:
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    model = Path(tempfile.mkdtemp(prefix="quantkit-sglang-toy-"))
    (model / "config.json").write_text(json.dumps(_TOY_CONFIG))
    args = prepare_server_args(["--model-path", str(model), "--attention-backend", "torch_native", "--device", "cpu"])
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
