"""The serving simulator's records (``simulator.py``): its configuration, its result, prefix-cache nodes and
requests, shared by the simulator and its fault injector (``simulator_faults.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

__all__ = ["SimConfig", "SimResult"]


@dataclass(frozen=True)
class SimConfig:
    """Workload and pool shape; small defaults keep 10,000 steps to a few seconds."""

    steps: int = 2000
    seed: int = 0
    fault_rate: float = 0.02
    tracker: Literal["tags", "noop"] = "tags"
    num_pages: int = 96
    page_size: int = 4
    max_running: int = 12
    prefixes: int = 4
    max_prefix_pages: int = 4
    max_suffix: int = 12
    max_new_tokens: int = 48
    arrival_rate: float = 0.6
    vocab: int = 1000


@dataclass
class SimResult:
    """What happened; the first six fields are the figures the CLI prints."""

    steps: int = 0
    faults_injected: int = 0
    faults_that_would_corrupt: int = 0
    faults_caught: int = 0
    wrong_data_served: int = 0
    false_aborts: int = 0
    tracker: str = "tags"
    seed: int = 0
    aborts: int = 0
    finished: int = 0
    preemptions: int = 0
    evictions: int = 0
    decode_tokens: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    uncaught_corrupting_faults: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Node:
    page: int
    tag: int | None
    refs: int


@dataclass(eq=False)
class _Request:
    rid: int
    stamps: np.ndarray  # expected content of every position of the full sequence
    prompt_len: int
    row: int = -1
    length: int = 0  # positions whose KV has been written
    pages: list[int] = field(default_factory=list)  # allocator's view, block-table order
    own: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)  # prefix-cache keys held
    faults: set[int] = field(default_factory=set)
    served_wrong: bool = False
