"""A sweep's record of its failed jobs (``failed_jobs.jsonl`` in the sweep directory), written
by any job's process: the end of the sweep names them, and ``python -m bake.compare`` lists even
the jobs refused before they ran."""

from __future__ import annotations

import json
from pathlib import Path

FAILURES = "failed_jobs.jsonl"


def record_failure(sweep_dir: Path, job: int, overrides: str, reason: str) -> None:
    """Append a failed job to its sweep's record (one line each, from any process)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"job": job, "overrides": overrides, "reason": reason[:500]})
    with open(sweep_dir / FAILURES, "a") as fh:
        fh.write(line + "\n")


def failures(sweep_dir: Path) -> list[dict]:
    """The sweep's failed jobs, in the order they failed."""
    path = sweep_dir / FAILURES
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a killed process: the others still count
            continue
    return out
