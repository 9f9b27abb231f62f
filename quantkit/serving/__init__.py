"""Serving-side pieces: KV-page integrity tracking (tags, ledger, batched check) and its simulator.

Names are imported lazily so that ``import quantkit.serving`` (done by the CLI) does not load torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "IntegrityConfig",
    "NoOpTracker",
    "PageTagTable",
    "SimConfig",
    "TagTracker",
    "make_tracker",
    "simulate",
]

_WHERE = {
    "IntegrityConfig": "tracker",
    "NoOpTracker": "tracker",
    "TagTracker": "tracker",
    "make_tracker": "tracker",
    "PageTagTable": "tags",
    "SimConfig": "simulator",
    "simulate": "simulator",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'quantkit.serving' has no attribute {name!r}")
    return getattr(import_module(f"quantkit.serving.{_WHERE[name]}"), name)
