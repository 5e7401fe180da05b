"""Errors a user can act on: each names the setting, the value and what to do."""

from __future__ import annotations

import shlex


class ConfigError(Exception):
    """One or more configuration problems, found before anything heavy runs (exit code 2)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def __str__(self) -> str:
        lines = [f"bake: invalid configuration ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class BakeError(Exception):
    """A runtime failure with a known cause (exit code 1, one line, no traceback)."""


class TrainingDiverged(BakeError):
    """The loss became NaN or infinite; the checkpoints written so far stay for `resume`."""


class StoreUnavailable(BakeError):
    """The tracking store could not be written (locked for too long by another process); the
    run's checkpoints stay and ``resume`` continues it, which the one line says."""


def resume_arg(run_dir) -> str:
    """``resume=<run dir>`` as a user pastes it into a shell: a path with spaces or shell
    characters quoted, and one with characters Hydra reads as syntax (``,`` would make a sweep)
    quoted for Hydra too."""
    value = str(run_dir)
    if any(c in value for c in ",[]{}()='\"\\"):
        value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return shlex.quote(f"resume={value}")
