"""``hydra/sweeper=bake_search``: an Optuna search over a bake's settings.

Each trial is one bake (a job of the sweep, a child of the sweep's MLflow parent); its value is
what bake's main returns, the exported model's HELD-OUT perplexity, which the search
minimises. The test split is never looked at: it stays the judge of the settings found.

The search space is Hydra's sweep syntax, in ``hydra.sweeper.params`` (the preset's) and on the
command line (which wins for a key in both)::

    phase_b.lr: tag(log, interval(3e-5, 1e-3))     # a float, log-uniform
    phase_b.ls_drift: interval(0, 1)               # a float, uniform
    phase_b.ls_chunks: choice(48, 96, 240)         # one of these (also: 48,96,240)
    phase_b.steps: range(60, 241, 60)              # one of 60, 120, 180, 240
    corpus.calib_chunks: tag(int, interval(48, 240))  # an integer

The study lives in the sweep directory (``optuna.journal``, Optuna's journal file). Launched
again on that directory (``python -m bake resume=<sweep dir>``), the search continues: trials
that finished count, a trial that was running resumes its bake exactly, and new trials are
asked until ``n_trials`` have run. ``n_jobs`` trials run at once with a launcher that runs jobs
in parallel (``hydra/launcher=bake_local``, ``bake_slurm``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.core.plugins import Plugins
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf

from bake.errors import BakeError
from bake.storage.record import RECORD
from bake.sweeps.checks import sweeper_problem
from bake.sweeps.directory import STUDY, SWEEP_FILE

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution

log = logging.getLogger("bake.search")

FINISHED_STATES = ("COMPLETE", "FAIL", "PRUNED")
DIGITS = 4  # significant digits of a searched float: 0.0003142, not 0.00031415926535


@dataclass
class SearchConf:
    """``hydra.sweeper`` of ``hydra/sweeper=bake_search`` (conf/hydra/sweeper/bake_search.yaml
    sets the search's defaults)."""

    _target_: str = "hydra_plugins.bake_sweeps.BakeSearch"
    n_trials: int = 20  # trials in all, those of earlier launches of the same search included
    n_jobs: int = 1  # trials at once (with a launcher that runs jobs in parallel)
    sampler: str = "tpe"  # tpe (Optuna's default) | random
    seed: int = 0  # the sampler's seed
    study_name: str = "bake"
    storage: str | None = None  # null: <sweep dir>/optuna.journal; or an Optuna storage URL
    # key -> Hydra's sweep syntax; null: only what the command line sweeps
    params: dict[str, str] | None = field(default_factory=dict)


def space(lines: Sequence[str]) -> tuple[list[str], dict[str, BaseDistribution]]:
    """(the fixed overrides, the searched keys and their Optuna distributions) of a search's
    overrides. Refuses a swept key whose syntax has no distribution (one line each)."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )  # lazy: optuna

    fixed: dict[str, str] = {}
    dists: dict[str, BaseDistribution] = {}
    for o in OverridesParser.create().parse_overrides(list(lines)):
        key = o.get_key_element()
        fixed.pop(key, None)
        dists.pop(key, None)
        if not o.is_sweep_override():
            fixed[key] = o.input_line or f"{key}={o.get_value_element_as_str()}"
            continue
        value = o.value()
        tags = set(getattr(value, "tags", set()))
        if isinstance(value, IntervalSweep):
            low, high = value.start, value.end
            assert low is not None and high is not None  # the grammar requires both
            if "int" in tags:
                dists[key] = IntDistribution(int(low), int(high), log="log" in tags)
            else:
                dists[key] = FloatDistribution(float(low), float(high), log="log" in tags)
        elif isinstance(value, ChoiceSweep | RangeSweep):
            dists[key] = CategoricalDistribution([v for v in o.sweep_iterator()])  # type: ignore[misc]
        else:
            raise BakeError(
                f"{o.input_line}: hydra/sweeper=bake_search searches interval(...), "
                f"choice(...) (or a,b,c) and range(...); write the key that way"
            )
    return list(fixed.values()), dists


def as_override(key: str, value: Any) -> str:
    """A trial's value as a command-line override (``phase_b.lr=0.0003142``): a float to
    :data:`DIGITS` significant digits."""
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    if isinstance(value, float):
        return f"{key}={float(f'{value:.{DIGITS}g}')!r}"
    return f"{key}={value}"


def study_storage(storage: str | None, sweep_dir: Path):
    """The study's storage: a journal file in the sweep directory unless a URL is given."""
    if storage:
        return storage
    from optuna.storages import JournalStorage  # lazy: optuna
    from optuna.storages.journal import JournalFileBackend  # lazy: optuna

    return JournalStorage(JournalFileBackend(str(sweep_dir / STUDY)))


def _check_study(c, sweep_dir: Path) -> None:
    """A search continues only with the study that made its jobs: jobs in the sweep directory
    with no study of ``hydra.sweeper.study_name`` to hold their trials (its journal lost,
    renamed, or another name given) would have their results credited to other settings; a
    journal that cannot be read is named, and left as it is."""
    import optuna  # lazy: optuna
    from optuna.exceptions import OptunaError  # lazy: optuna

    jobs = (
        sorted(
            (p.name for p in sweep_dir.iterdir() if p.name.isdigit() and (p / RECORD).is_file()),
            key=int,
        )
        if sweep_dir.is_dir()
        else []
    )
    journal = sweep_dir / STUDY
    if c.storage is None and not journal.exists():
        trials = None
    else:
        where = c.storage or str(journal)
        try:
            study = optuna.load_study(
                study_name=c.study_name, storage=study_storage(c.storage, sweep_dir)
            )
            trials = len(study.get_trials(deepcopy=False))
        except KeyError:  # no study of that name
            trials = None
        except (OptunaError, AssertionError, ValueError, OSError) as exc:
            raise BakeError(
                f"{where}: the search's study cannot be read ({type(exc).__name__}: "
                f"{str(exc)[:200]}); nothing was written to it: restore it, or start the search "
                f"in another hydra.sweep.dir"
            ) from None
    if jobs and not trials:
        raise BakeError(
            f"hydra.sweep.dir={sweep_dir} holds {len(jobs)} job(s) of a search whose study "
            f"'{c.study_name}' is not in {c.storage or journal} (lost, renamed, or the file is "
            f"damaged): their results would be credited to other settings; restore the study (or "
            f"its hydra.sweeper.study_name), or start the search in another hydra.sweep.dir"
        )


def make_sampler(name: str, seed: int):
    from optuna.samplers import RandomSampler, TPESampler  # lazy: optuna

    if name == "tpe":
        return TPESampler(seed=seed)
    if name == "random":
        return RandomSampler(seed=seed)
    raise BakeError(f"hydra.sweeper.sampler={name}: not one of tpe, random")


class Search:
    """The search's work; :class:`hydra_plugins.bake_sweeps.BakeSearch` is the Hydra plugin
    that holds it."""

    def __init__(self, conf: SearchConf) -> None:
        self.conf = conf
        self.config: Any = None
        self.launcher: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context, task_function, config) -> None:

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> list:
        import optuna  # lazy: optuna

        c = self.conf
        wrong = sweeper_problem(c)
        if wrong:
            raise BakeError(wrong)
        lines = [f"{k}={v}" for k, v in (c.params or {}).items()] + list(arguments)
        fixed, dists = space(lines)
        if not dists:
            raise BakeError(
                "hydra/sweeper=bake_search: nothing to search; give a key a range, e.g. "
                "'phase_b.lr=tag(log, interval(3e-5, 1e-3))', or leave out "
                "hydra.sweeper.params=null (the preset's search)"
            )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # bake says what each trial did
        _check_study(c, sweep_dir)  # before anything is written into the sweep directory
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / SWEEP_FILE)
        study = optuna.create_study(
            study_name=c.study_name,
            storage=study_storage(c.storage, sweep_dir),
            sampler=make_sampler(c.sampler, c.seed),
            direction="minimize",
            load_if_exists=True,
        )
        self._say_start(study, dists)
        returns = []
        for batch in self._batches(study, dists):
            overrides = [fixed + self._settings(t) for t in batch]
            results = self.launcher.launch(overrides, initial_job_idx=batch[0].number)
            for trial, ret in zip(batch, results, strict=True):
                self._tell(study, trial, ret)
            returns.append(results)
        self._say_best(study, sweep_dir)
        return returns

    def _batches(self, study: Study, dists: dict[str, BaseDistribution]):
        """Trials to run, at most ``n_jobs`` at once, in launches of consecutive numbers (a
        trial's number is its job's): first those an earlier launch left running (they resume
        their bakes), then new ones until ``n_trials`` have run."""
        from optuna.trial import TrialState  # lazy: optuna

        trials = study.get_trials(deepcopy=False)
        unfinished = sorted(
            (t for t in trials if t.state == TrialState.RUNNING), key=lambda t: t.number
        )
        done = sum(t.state.name in FINISHED_STATES for t in trials)
        batch: list[Any] = []
        for t in unfinished:
            if batch and (len(batch) == self.conf.n_jobs or t.number != batch[-1].number + 1):
                yield batch
                batch = []
            batch.append(t)
        if batch:
            yield batch
        left = self.conf.n_trials - done - len(unfinished)
        while left > 0:
            asked: list[Any] = [study.ask(dists) for _ in range(min(self.conf.n_jobs, left))]
            left -= len(asked)
            numbers = [t.number for t in asked]
            if numbers != list(range(numbers[0], numbers[0] + len(numbers))):  # another process
                for t in asked:  # asks in the same study: one launch per trial
                    yield [t]
            else:
                yield asked

    @staticmethod
    def _settings(trial) -> list[str]:
        """The overrides a trial runs with: its values, floats to :data:`DIGITS` significant
        digits (a setting a person reads and types again), kept on the trial so that a trial
        continued later runs with exactly these."""
        if "overrides" not in trial.user_attrs:
            trial.set_user_attr("overrides", [as_override(k, v) for k, v in trial.params.items()])
        return list(trial.user_attrs["overrides"])

    def _tell(self, study: Study, trial, ret) -> None:
        from optuna.trial import TrialState  # lazy: optuna

        value = ret.return_value if ret.status == JobStatus.COMPLETED else None
        value = float(value) if isinstance(value, int | float) else math.nan
        settings = " ".join(self._settings(trial))
        if math.isfinite(value):
            study.tell(trial.number, value)
            best = study.best_trial
            print(
                f"search: trial {trial.number} ({settings}): exported held-out perplexity "
                f"{value:.4f}; best so far: trial {best.number}, {best.value:.4f}",
                flush=True,
            )
        else:
            study.tell(trial.number, state=TrialState.FAIL)
            print(f"search: trial {trial.number} ({settings}) failed", flush=True)

    def _say_start(self, study: Study, dists: dict[str, BaseDistribution]) -> None:
        done = [t for t in study.get_trials(deepcopy=False) if t.state.name in FINISHED_STATES]
        keys = ", ".join(dists)
        earlier = f"; {len(done)} trial(s) of earlier launches count" if done else ""
        print(
            f"search: {self.conf.n_trials} trials over {keys}, minimising the exported model's "
            f"held-out perplexity, {self.conf.n_jobs} at once{earlier}",
            flush=True,
        )

    def _say_best(self, study: Study, sweep_dir: Path) -> None:
        from optuna.trial import TrialState  # lazy: optuna

        complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not complete:
            print("search: no trial finished", flush=True)
            return
        best = study.best_trial
        settings = " ".join(best.user_attrs.get("overrides", []))
        print(
            f"search: best trial {best.number} of {len(complete)} finished: exported held-out "
            f"perplexity {best.value:.4f} with {settings} (run directory "
            f"{sweep_dir / str(best.number)})",
            flush=True,
        )
