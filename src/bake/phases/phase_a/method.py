"""What a Phase A method is, and the registry of them.

A method's module builds one :class:`Method` and registers it (:func:`register`): its name (the
value of ``phase_a.method``), whether it trains, whether least squares chooses its neurons, the
``phase_a`` keys it reads, its parameters (a dataclass that checks its own values, or None for a
method with none) and its run. The built-in methods register when :mod:`bake.phases.phase_a` is
imported; a method of another package registers when that package is imported, or through the
``bake.phase_a`` entry point group of an installed distribution. Its preset is a YAML file under
``phase_a/`` on Hydra's search path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from bake.errors import ConfigError

if TYPE_CHECKING:
    from bake.phases.phase_a.results import PhaseAResult

ENTRY_POINTS = "bake.phase_a"  # an installed distribution's methods: name = module:object


class Params(Protocol):
    """A method's own parameters, read from the ``phase_a`` section: a dataclass whose
    ``__post_init__`` raises :class:`ConfigError` naming every value out of range."""

    @property
    def tau(self) -> float:
        """The threshold that binarises its mask logits."""

    @property
    def ranked(self) -> bool:
        """Its structure is read by rank (no threshold consulted)."""

    @property
    def uses_target(self) -> bool:
        """Its result depends on ``phase_a.target_sparsity`` (cached per target)."""


@dataclass(frozen=True)
class Method:
    """One Phase A method."""

    name: str  # phase_a.method
    label: str  # how the log and the report name it
    # (the run context, a callback per evaluation) -> its result (the context's module sits above
    # the settings that read this registry, so the signature names it only here)
    run: Callable[..., PhaseAResult]
    reads: Mapping[str, str]  # the phase_a keys it reads -> what each does (others: unused)
    trains: bool  # trains a mask: cached by its settings, resumed from its checkpoints
    least_squares_chooses: bool  # least squares chooses the neurons at the widths it gives
    # (phase_a section, evaluation precision, evaluation batch) -> its parameters; None: none
    params: Callable[[Any, str, int], Params] | None
    # phase_a section -> the keys it does not read with its other settings, and why
    unread: Callable[[Any], dict[str, str]]
    # (the composed config, the model's loops) -> what it needs of other groups, one line each
    rules: Callable[[Any, int], list[str]]

    def params_of(self, a, precision: str = "fp32", eval_batch: int = 1) -> Params | None:
        """Its parameters from the ``phase_a`` section ``a`` (ConfigError: values out of
        range)."""
        return None if self.params is None else self.params(a, precision, eval_batch)

    def problems(self, a) -> list[str]:
        """Every value of the ``phase_a`` section ``a`` its parameters refuse, one line each."""
        try:
            self.params_of(a)
        except ConfigError as exc:
            return list(exc.problems)
        return []


def nothing_unread(a) -> dict[str, str]:
    """A method that reads every key it lists, whatever their values."""
    return {}


def no_rules(cfg, loops: int) -> list[str]:
    """A method that works with any setting of the other groups."""
    return []


_METHODS: dict[str, Method] = {}
_LOADED: list[bool] = []


def register(method: Method) -> Method:
    """Make ``method`` choosable as ``phase_a.method=<its name>``; returns it."""
    known = _METHODS.get(method.name)
    if known is not None and known.run.__module__ != method.run.__module__:
        raise ValueError(
            f"phase_a.method={method.name} is registered by {known.run.__module__} and by "
            f"{method.run.__module__}: give one of them another name"
        )
    _METHODS[method.name] = method
    return method


def _installed() -> None:
    """The methods of installed distributions (entry point group ``bake.phase_a``), once."""
    if _LOADED:
        return
    _LOADED.append(True)
    for ep in entry_points(group=ENTRY_POINTS):
        register(ep.load())


def registered() -> list[Method]:
    """Every registered method, by name."""
    _installed()
    return [_METHODS[n] for n in sorted(_METHODS)]


def names() -> list[str]:
    """The registered methods' names."""
    _installed()
    return sorted(_METHODS)


def get(name: str) -> Method:
    """The method registered as ``name`` (ConfigError naming the registered ones)."""
    _installed()
    method = _METHODS.get(str(name))
    if method is None:
        raise ConfigError(
            [
                f"phase_a.method={name}: not a Phase A method; choose one of "
                f"{', '.join(sorted(_METHODS))} (or import the package that registers it)"
            ]
        )
    return method
