"""A model's score on its task: greedy completions of every problem (:mod:`bake.task.generate`),
each judged by running its program in the sandbox (:mod:`bake.task.sandbox`); pass@1 is the
fraction that passes.

The backbone's score depends only on its files, the problems, the generation and execution
settings, this code and the transformers version; it is kept in the shared cache
(``paths.cache/task/``), built once under the cache lock, so the jobs of a sweep score the
backbone once.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bake.models.stack import autocast_for
from bake.storage import cache
from bake.storage.files import atomic_write
from bake.task import problems as problem_set
from bake.task import sandbox
from bake.task.generate import Generation, complete
from bake.task.problems import Problem
from bake.tracking import console

log = logging.getLogger("bake")
CODE = (
    "bake.task.problems",
    "bake.task.generate",
    "bake.task.sandbox",
    "bake.task.score",
)  # a change to any of them is never answered from a cached score


@dataclass(frozen=True)
class TaskSpec:
    """The ``task`` section resolved: which problems, how completions are made and run."""

    name: str
    source: str  # none | humaneval | unit_tests
    path: str | None
    limit: int | None
    gen: Generation
    limits: sandbox.Limits

    @property
    def enabled(self) -> bool:
        return self.source != "none"

    def settings(self) -> dict:
        """What a score depends on besides the model and the problems (cache keys, reports)."""
        return {
            "max_new_tokens": self.gen.max_new_tokens,
            "stop": list(self.gen.stop),
            "batch": self.gen.batch,
            "timeout_s": self.limits.timeout_s,
            "memory_gib": self.limits.memory_gib,
            "greedy": True,
        }


def spec_of(tcfg) -> TaskSpec:
    """The task section of a composed config (a missing section, from a run made before tasks
    existed, reads as ``task=none``)."""
    if tcfg is None:
        return TaskSpec("none", "none", None, None, Generation(1, (), 1), sandbox.Limits(1, 1))
    return TaskSpec(
        name=str(tcfg.name),
        source=str(tcfg.source),
        path=None if tcfg.path is None else str(tcfg.path),
        limit=None if tcfg.limit is None else int(tcfg.limit),
        gen=Generation(int(tcfg.max_new_tokens), tuple(str(s) for s in tcfg.stop), int(tcfg.batch)),
        limits=sandbox.Limits(float(tcfg.timeout_s), float(tcfg.memory_gib)),
    )


@dataclass
class Score:
    """A model's results on the problems."""

    results: list[dict]  # per problem: task_id, passed, result, completion
    seconds: dict = field(default_factory=dict)  # generate, execute
    cached: bool = False

    @property
    def passed(self) -> int:
        return sum(1 for r in self.results if r["passed"])

    @property
    def problems(self) -> int:
        return len(self.results)

    @property
    def pass_at_1(self) -> float:
        return self.passed / self.problems if self.results else math.nan

    def summary(self) -> dict:
        return {
            "passed": self.passed,
            "problems": self.problems,
            "pass_at_1": self.pass_at_1,
            "seconds": self.seconds,
            "cached": self.cached,
        }


def execute(
    items: list[Problem], completions: list[str], spec: TaskSpec, label: str = ""
) -> list[dict]:
    """Each completion's program run in the sandbox; the per-problem records."""
    programs = [p.program(c) for p, c in zip(items, completions, strict=True)]
    outcome = sandbox.run_all(programs, spec.limits)
    return [
        {"task_id": p.task_id, "passed": r == "passed", "result": r, "completion": c}
        for p, c, r in zip(items, completions, outcome, strict=True)
    ]


def score(
    model, tokenizer, items: list[Problem], spec: TaskSpec, label: str, precision: str = "fp32"
) -> Score:
    """``model``'s greedy completions of ``items``, each run against its tests."""

    t0 = time.perf_counter()
    progress = _progress(len(items), f"[T] {spec.name} {label}", spec.gen.batch)
    device = next(model.parameters()).device
    try:
        with autocast_for(device, precision):
            completions = complete(
                model, tokenizer, [p.prompt for p in items], spec.gen, lambda i, _: progress()
            )
    finally:
        progress.close()
    t1 = time.perf_counter()
    results = execute(items, completions, spec, label)
    seconds = {"generate": t1 - t0, "execute": time.perf_counter() - t1}
    out = Score(results, seconds)
    log.info(
        "[T] %s %s: %d of %d pass (pass@1 %.3f); %.0f s generating, %.0f s running the tests",
        spec.name,
        label,
        out.passed,
        out.problems,
        out.pass_at_1,
        seconds["generate"],
        seconds["execute"],
    )
    return out


class _progress:
    """A bar on a terminal; otherwise a log line each ``every`` problems."""

    def __init__(self, total: int, what: str, every: int):
        self.total, self.what, self.every, self.done = total, what, max(1, every), 0
        self.t0 = time.perf_counter()
        self.bar = None
        if console.interactive():
            self.bar = tqdm(total=total, desc=what, unit="problem", leave=False)

    def __call__(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.done % self.every == 0 or self.done == self.total:
            log.info(
                "%s: %d of %d problems generated (%.0f s)",
                self.what,
                self.done,
                self.total,
                time.perf_counter() - self.t0,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def chosen(spec: TaskSpec) -> list[Problem]:
    """The task's problems, ``task.limit`` applied."""
    return problem_set.limited(problem_set.load(spec), spec.limit)


def backbone_key(model_key: str, items: list[Problem], spec: TaskSpec) -> str:
    """The cache identity of the backbone's score."""
    import transformers  # lazy: transformers

    return cache.digest(
        {
            "model": model_key,
            "problems": problem_set.digest(items),
            "settings": spec.settings(),
            "code": cache.code_digest(CODE),
            "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0],
        }
    )


def backbone(
    model_key: str,
    load: Callable[[], tuple],
    items: list[Problem],
    spec: TaskSpec,
    cache_dir: Path,
    precision: str,
) -> Score:
    """The backbone's score, from the shared cache or computed once (``load()`` returns the
    backbone as transformers loads it and its tokenizer)."""
    path = cache_dir / "task" / f"{spec.name}-{backbone_key(model_key, items, spec)}.json"
    with cache.building(path):
        got = cache.read(path, _read_score)
        if got is not None:
            log.info("[T] %s backbone: reusing its cached score (%s)", spec.name, path)
            return got
        model, tokenizer = load()
        try:
            out = score(model, tokenizer, items, spec, "backbone", precision)
        finally:
            del model
        text = json.dumps({"results": out.results, "seconds": out.seconds}) + "\n"

        with atomic_write(path) as tmp:
            tmp.write_text(text)
        cache.seal(path)
    return out


def _read_score(path: Path) -> Score:
    data = json.loads(path.read_text())
    results = data["results"]
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise ValueError("not a list of results")
    return Score(results, data.get("seconds", {}), cached=True)


def write_results(path: Path, results: list[dict]) -> None:
    """The per-problem file, ``task/<name>.jsonl``: task_id, passed, result, completion."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in results:
            fh.write(json.dumps(r) + "\n")
