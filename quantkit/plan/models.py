"""Resolve what the user names (`glm-5.2`, a config.json, a checkpoint directory) to a config.

The planner works from `config.json` alone; the bundled configs of the target models make
`quantkit plan glm-5.2` work with nothing downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from quantkit.core.errors import QuantkitError
from quantkit.core.jsontypes import JSONObject

__all__ = ["BUNDLED", "ModelSource", "bundled_names", "load_config", "resolve_model"]

# name -> (bundled folder, human name, reconstructed?)
BUNDLED: dict[str, tuple[str, str, bool]] = {
    "kimi-k2.6": ("kimi-k2.6", "Kimi K2.6", False),
    "kimi-k2-thinking": ("kimi-k2-thinking", "Kimi K2 Thinking", True),
    "glm-5.2": ("glm-5.2", "GLM-5.2", False),
    "glm-5.1": ("glm-5.1", "GLM-5.1", True),
    "glm-4.7": ("glm-4.7", "GLM-4.7", False),
    "deepseek-v3": ("deepseek-v3", "DeepSeek V3", False),
}
_ALIASES = {
    "kimi-k2.5": "kimi-k2.6",
    "k2.6": "kimi-k2.6",
    "kimi-k2": "kimi-k2-thinking",
    "glm5.2": "glm-5.2",
    "glm5.1": "glm-5.1",
    "glm-5": "glm-5.1",
    "glm4.7": "glm-4.7",
    "deepseek-v3.1": "deepseek-v3",
    "dsv3": "deepseek-v3",
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: its config, a display name, and the checkpoint directory if there is one."""

    name: str
    config: JSONObject
    checkpoint_dir: Path | None = None
    note: str = ""


def bundled_names() -> list[str]:
    """Names `quantkit plan` accepts without a path."""
    return sorted(BUNDLED)


def load_config(path: Path) -> JSONObject:
    """Read a config.json, turning I/O and JSON errors into one-line user errors."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, RecursionError) as exc:
        raise QuantkitError(f"{path}: cannot read config ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise QuantkitError(f"{path}: config.json must hold a JSON object")
    return data


def _has_shards(directory: Path) -> bool:
    return any(directory.glob("*.safetensors"))


def resolve_model(spec: str) -> ModelSource:
    """A bundled model name, a path to a config.json, or a checkpoint directory."""
    key = _ALIASES.get(spec.lower(), spec.lower())
    if key in BUNDLED:
        folder, human, reconstructed = BUNDLED[key]
        text = resources.files("quantkit.plan").joinpath("configs", folder, "config.json")
        config = json.loads(text.read_text(encoding="utf-8"))
        note = "config reconstructed, see quantkit/plan/configs/PROVENANCE.md" if reconstructed else ""
        return ModelSource(human, config, None, note)
    path = Path(spec)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise QuantkitError(f"{path}: no config.json in this directory")
        return ModelSource(path.name, load_config(config_path), path if _has_shards(path) else None)
    if path.is_file():
        return ModelSource(path.parent.name or path.name, load_config(path), None)
    raise QuantkitError(f"{spec}: not a bundled model ({', '.join(bundled_names())}) nor a file or directory")
