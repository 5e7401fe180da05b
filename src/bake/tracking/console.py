"""The terminal a person watches: log lines never land on a progress bar's row, and libraries
keep the progress bars and warnings a user cannot act on to themselves.

Lightning draws its bars on stderr with carriage returns; Hydra's console handler writes whole
lines to stdout. On a terminal both reach one screen, so a line written while a bar is drawn
starts on the bar's row (or on the row a closing bar moved the cursor up to). Each console
handler that writes to a terminal gets a stream that clears the bars, writes the line and draws
the bars again below it, as ``tqdm.write`` does. Without a terminal there are no bars and the
log is written as it always was.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

# Warnings of the libraries that a bake's user cannot act on (bake's own settings cause them).
QUIET_WARNINGS = (
    ".*LeafSpec.*",  # torch's pytree deprecation, raised inside Lightning
    ".*does not have many workers.*",  # the loaders hold step numbers, not data
)
# Loggers whose INFO lines are chatter (database creation, accelerator lines, tips). Set on the
# loggers themselves: importing mlflow resets the level of its "mlflow" logger.
QUIET_LOGGERS = (
    "mlflow.store.db.utils",
    "alembic",
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
)


class BarSafeStream:
    """A terminal stream that clears tqdm's bars before each write and redraws them after."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:

        from tqdm import tqdm  # lazy: tqdm

        with tqdm.get_lock():
            bars = [b for b in list(tqdm._instances) if not b.disable and hasattr(b, "start_t")]
            for bar in bars:
                bar.clear(nolock=True)
            n = self.stream.write(text)
            self.stream.flush()  # the line is out before a bar is drawn again
            for bar in bars:
                bar.refresh(nolock=True)
        return n

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self.stream, name)


# What a run cut short must still do before the process exits (a sweep's parent run: its
# summary so far, KILLED; bake.tracking.sweep registers it)
_ON_INTERRUPT: list[Callable[[], None]] = []


def on_interrupt(hook: Callable[[], None]) -> None:
    """Call ``hook`` when the command line is interrupted (:func:`interrupted`)."""
    _ON_INTERRUPT.append(hook)


def forget_interrupt(hook: Callable[[], None]) -> None:
    if hook in _ON_INTERRUPT:
        _ON_INTERRUPT.remove(hook)


def interrupted() -> None:
    """The command line was interrupted (Ctrl-C, SIGTERM): every registered hook, once."""
    for hook in list(_ON_INTERRUPT):
        forget_interrupt(hook)
        hook()


def interactive() -> bool:
    """True when stderr, where the bars are drawn, is a terminal."""
    return sys.stderr.isatty()


def quiet_libraries() -> None:
    """No library progress bars (transformers' "Loading weights", the Hub's downloads), and no
    chatter a user cannot act on; bake's own log lines are untouched."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when the Hub is imported
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars  # lazy: huggingface_hub

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # lazy: transformers

        hf_logging.disable_progress_bar()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Its errors (a locked store, with a full traceback) reach bake as exceptions, which bake
    # waits out or reports in one line (bake.tracking.tracker.patiently).
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def setup() -> None:
    """Quiet the libraries; on a terminal, route log lines (and warnings) around the bars."""
    quiet_libraries()
    if not interactive():
        return
    logging.captureWarnings(True)  # a warning is a log line, written around the bars too
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            stream = getattr(handler, "stream", None)
            if isinstance(handler, logging.FileHandler) or stream is None:
                continue
            if not isinstance(stream, BarSafeStream) and _is_tty(stream):
                handler.setStream(BarSafeStream(stream))


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


_INTERRUPTED: list[bool] = []
_SIGNALLED: list[int] = []  # the signal that ended this process's work, when one did


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler ending the job): it unwinds as Ctrl-C does, so the run is
    recorded KILLED in its record and in MLflow, and its checkpoints stay for a resume."""


def forget_signal() -> None:
    """A new command line of this process starts with no signal received."""
    _SIGNALLED.clear()


def terminate(signum, frame) -> None:
    """SIGTERM handler of the command line: raise :class:`Terminated` where the work is."""
    _SIGNALLED[:] = [signum]
    raise Terminated


def interrupt_code() -> int:
    """The exit code of an interrupted bake: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""

    return 128 + (_SIGNALLED[0] if _SIGNALLED else int(signal.SIGINT))


def defer_interrupt(signum, frame) -> None:
    """SIGINT handler while libraries are imported: note the Ctrl-C, raise it later."""
    _INTERRUPTED.append(True)


def allow_interrupts() -> None:
    """Import the heavy libraries, restore Ctrl-C's usual KeyboardInterrupt, and raise one if
    Ctrl-C was pressed meanwhile."""

    import lightning  # noqa: F401  # lazy: lightning
    import mlflow  # noqa: F401  # lazy: mlflow
    import torch  # noqa: F401  # lazy: torch
    import transformers  # noqa: F401  # lazy: transformers

    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is defer_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if _INTERRUPTED:
        _INTERRUPTED.clear()
        raise KeyboardInterrupt


class Progress:
    """A long stage's progress (least squares' layers, the activation statistics' batches): a
    bar on a terminal, otherwise a log line at each of about ``lines`` even steps, so a user
    sees a stage of several minutes move in a log file too."""

    def __init__(self, what: str, total: int, unit: str, log: logging.Logger, lines: int = 6):
        self.what, self.total, self.unit, self.log = what, max(0, total), unit, log
        self.every = max(1, -(-self.total // max(1, lines)))  # ceil(total / lines)
        self.done, self.t0 = 0, time.perf_counter()
        self.bar = None
        if interactive() and self.total:
            from tqdm import tqdm  # lazy: tqdm

            self.bar = tqdm(total=self.total, desc=what, unit=unit, leave=False, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def advance(self, n: int = 1) -> None:
        """``n`` more of its units done."""
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            self.bar.update(n)
        elif self.done == self.total or self.done // self.every > before // self.every:
            seconds = time.perf_counter() - self.t0
            self.log.info(
                "%s: %d of %d %s (%.0f s)", self.what, self.done, self.total, self.unit, seconds
            )
