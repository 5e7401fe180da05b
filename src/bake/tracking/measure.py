"""Resident memory of this process (Linux /proc; None elsewhere): current, and the peak since
the last reset, so a bake can report what each stage cost on top of the loaded model."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import signal
import threading
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _field(name: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    except OSError:
        return None
    return None


def rss_mb() -> float | None:
    """Resident memory now, MiB."""
    return _field("VmRSS")


def peak_mb() -> float | None:
    """Peak resident memory since the process started or since :func:`reset_peak`, MiB."""
    return _field("VmHWM")


def trim() -> None:
    """Give the C heap's free pages back to the system (glibc), so that what one phase freed
    does not stay resident under the next."""

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def collect() -> None:
    """Collect the garbage a finished stage left (a phase's module and trainer hold reference
    cycles) and give its memory back (:func:`trim`), with Ctrl-C held until both are done: a
    Ctrl-C that lands in a finalizer run by the collection (Lightning's ``Profiler.__del__``)
    would be printed as "Exception ignored" and lost; held, it is raised right after. It is held
    by a handler that only notes it (blocking the signal would hold it in this thread only, and
    the kernel hands a process's signal to any thread that does not block it)."""

    if threading.current_thread() is not threading.main_thread():
        gc.collect()
        trim()
        return
    pressed: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        gc.collect()
        trim()
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        signal.raise_signal(signal.SIGINT)  # to the handler that was there: raised now


def reset_peak() -> bool:
    """Restart the peak from the current resident memory (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakTracker:
    """Peak resident memory of each stage after the model and corpus are loaded."""

    def __init__(self) -> None:
        self.loaded: float | None = None
        self.load_peak: float | None = None  # the process's peak up to the loaded model
        self.stages: dict[str, float | None] = {}

    def start(self) -> None:
        self.loaded = rss_mb()
        self.load_peak = peak_mb()
        reset_peak()

    def stage_done(self, name: str) -> None:
        self.stages[name] = peak_mb()
        reset_peak()

    def summary(self) -> dict:
        peaks = [p for p in self.stages.values() if p is not None]
        peak = max(peaks) if peaks else None
        ratio = peak / self.loaded if peak and self.loaded else None
        return {
            "rss_after_load_mb": self.loaded,
            "load_peak_mb": self.load_peak,
            "peak_mb": peak,
            "peak_over_loaded": ratio,
            "stage_peaks_mb": dict(self.stages),
        }
