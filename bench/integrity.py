"""Benchmark the KV-page integrity check: ``python bench/integrity.py [--json] [--device cuda] ...``.

A thin wrapper over ``quantkit bench integrity`` so the figures in docs/benchmarks.md can be
reproduced from a checkout without installing the entry point. All options are the CLI's.
"""

from __future__ import annotations

import sys

from quantkit.cli import app


def main(argv: list[str]) -> None:
    app(["bench", "integrity", *argv], standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
