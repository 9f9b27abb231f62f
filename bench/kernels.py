"""Run the kernel benchmark and write it as JSON and Markdown (for docs/benchmarks.md).

    python bench/kernels.py                 # full sweep on a GPU, smoke run on CPU
    python bench/kernels.py --out bench/out # also writes kernels.json and kernels.md there
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.kernels.bench import format_rows, run_benchmark  # noqa: E402


def main() -> None:
    """Parse arguments, run, print the table, optionally save both forms."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes even on a GPU")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="peak HBM bandwidth if the GPU is unknown")
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="folder for kernels.json and kernels.md")
    args = parser.parse_args()
    result = run_benchmark(smoke=True if args.smoke else None, hbm=args.hbm_gbps, group_size=args.group_size)
    table = format_rows(result)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.json").write_text(json.dumps(result, indent=2))
        (args.out / "kernels.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
