"""Run jobs one by one in forked children of an interpreter that has imported an engine once (both runners'
`--batch`): every job starts from the same freshly imported state, and its report is written by the child."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_forked"]


def run_forked(jobs: list[dict[str, Any]], run_job: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """For each job, fork; the child writes `run_job(job)` as JSON to `job["out"]`. Returns 1 if any failed."""
    failures = 0
    for job in jobs:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                report = run_job(job)
                Path(job["out"]).write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
                code = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        failures += int(os.waitstatus_to_exitcode(status) != 0)
    return 1 if failures else 0
