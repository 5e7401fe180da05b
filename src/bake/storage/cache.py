"""Entries of the shared cache (``paths.cache``) that prove themselves: each is written
atomically with a SHA-256 checksum beside it (``<entry>.sha256``; for a directory, over every
file in it). Read back, an entry whose checksum is missing or wrong, or that its reader cannot
parse, is reported once as a warning naming it, removed, and rebuilt by the caller: a truncated
or corrupt file never makes every later bake crash.

Bakes running at once (a sweep's parallel jobs) share the cache: an entry is checked and, when
missing, built and sealed under its lock (:func:`building`), so it is built once, and never
read half-sealed nor removed as corrupt while another bake is still writing it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from bake.storage.files import atomic_write

log = logging.getLogger("bake.cache")
T = TypeVar("T")
_CHUNK = 1 << 20


@contextmanager
def building(path: Path) -> Iterator[None]:
    """Hold the lock of the cache entry ``path`` (``.<name>.lock`` beside it) while it is read
    or built: a second bake that needs the same entry waits, then reads what the first built.
    The kernel releases the lock of a process that dies."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("cache: %s is being built by another bake; waiting for it", path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def checksum(path: Path) -> str:
    """SHA-256 of a file, or of a directory's files (names and contents, sorted)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def seal(path: Path) -> None:
    """Record the checksum of a complete entry (call after it is in place)."""
    with atomic_write(_sidecar(path)) as tmp:
        tmp.write_text(checksum(path) + "\n")


def drop(path: Path) -> None:
    """Remove an entry and its checksum."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)


def verified(path: Path) -> bool:
    """True when ``path`` exists and matches its checksum; a corrupt entry is reported and
    removed (False)."""
    if not path.exists():
        return False
    side = _sidecar(path)
    try:
        ok = side.is_file() and side.read_text().strip() == checksum(path)
        why = "its checksum does not match" if side.is_file() else "it has no checksum"
    except OSError as exc:
        ok, why = False, f"unreadable: {exc}"
    if not ok:
        _corrupt(path, why)
    return ok


def read(path: Path, reader: Callable[[Path], T]) -> T | None:
    """``reader(path)`` for a verified entry; None (the caller rebuilds) when it is missing,
    corrupt or unreadable."""
    if not verified(path):
        return None
    try:
        return reader(path)
    except Exception as exc:  # a sealed entry a newer reader cannot parse: rebuild it too
        _corrupt(path, f"{type(exc).__name__}: {exc}")
        return None


def _corrupt(path: Path, why: str) -> None:
    log.warning("cache: %s is corrupt (%s); removing it, it will be rebuilt", path, why)
    drop(path)


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_digest(modules: tuple[str, ...]) -> str:
    """A hash of the source files of ``modules`` (dotted names): part of the key of every cache
    whose content they compute, so a change to the code can never be answered from a cache
    written by the old code."""

    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ValueError(f"no source for module {name}")
        h.update(name.encode() + b"\0" + Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]
