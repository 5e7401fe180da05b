"""``corpus.glob`` expanded the way ``glob.glob(..., recursive=True)`` does (``*``, ``?``,
``[...]``, ``**`` for any depth, hidden names only when the pattern spells their dot), but
safely: a directory reached twice through symbolic links (a loop, or two links to one place) is
walked once, so a link loop neither hangs bake nor repeats files.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

_MAGIC = set("*?[")


def _magic(part: str) -> bool:
    return any(c in _MAGIC for c in part)


def _matches(name: str, part: str) -> bool:
    if name.startswith(".") and not part.startswith("."):
        return False  # as glob: wildcards never match a leading dot
    return fnmatch.fnmatchcase(name, part)


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:  # unreadable or vanished: nothing to match there
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symbolic links
    except OSError:
        return False


def expand(pattern: str) -> list[Path]:
    """Files matching ``pattern`` (relative to the working directory unless absolute), sorted;
    each real directory is walked at most once per ``**``."""
    parts = Path(os.path.expanduser(pattern)).parts
    first = next((i for i, part in enumerate(parts) if _magic(part)), len(parts))
    root = Path(*parts[:first]) if first else Path(".")
    if first == len(parts):
        return [root] if root.is_file() else []
    found: list[Path] = []
    _walk(root, parts[first:], found, set())
    return sorted(set(found))


def _walk(directory: Path, rest: tuple[str, ...], found: list[Path], seen: set) -> None:
    part, tail = rest[0], rest[1:]
    if part == "**":
        for sub in _below(directory, seen):
            if tail:
                _walk(sub, tail, found, seen)
            else:
                found += [sub / e.name for e in _entries(sub) if e.is_file() and e.name[0] != "."]
        return
    for entry in _entries(directory):
        if not _matches(entry.name, part):
            continue
        path = directory / entry.name if directory != Path(".") else Path(entry.name)
        if not tail:
            if entry.is_file():
                found.append(path)
        elif _is_dir(entry):
            _walk(path, tail, found, seen)


def _below(directory: Path, seen: set) -> list[Path]:
    """``directory`` and every directory under it (hidden ones left out), each real directory
    once."""
    out: list[Path] = []
    todo = [directory]
    while todo:
        current = todo.pop()
        try:
            st = current.stat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        out.append(current)
        for entry in reversed(_entries(current)):
            if entry.name[0] != "." and _is_dir(entry):
                todo.append(current / entry.name if current != Path(".") else Path(entry.name))
    return out
