"""The task's documents: the standard library's sources, files matching a glob, or the lines of a
JSON Lines file, each read once as UTF-8 text (binary, empty, undecodable or repeated content is
skipped and counted)."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bake.config import CorpusSource
from bake.corpus.globbing import expand
from bake.errors import BakeError


@dataclass
class Document:
    ident: str
    path: Path | None = None
    text: str | None = None


def stdlib_dir() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_docs() -> list[Document]:

    root = stdlib_dir()
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        paths += [Path(folder) / f for f in files if f.endswith(".py")]
    return [Document(str(p.relative_to(root)), path=p) for p in sorted(paths)]


def _glob_docs(pattern: str) -> list[Document]:
    """Files matching ``pattern``, each once: a file reached by several paths (symbolic links)
    counts once, under the first path in sorted order."""

    seen: set[str] = set()
    docs = []
    for path in expand(pattern):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            docs.append(Document(str(path), path=path))
    return docs


def _jsonl_docs(path: str, key: str, rejected: Counter) -> list[Document]:
    """One document per line with a string under ``key``; other lines counted in ``rejected``."""
    docs = []
    with open(Path(path).expanduser(), "rb") as fh:
        for i, raw in enumerate(fh, 1):
            if not raw.strip():
                rejected["blank"] += 1
                continue
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rejected["not valid JSON"] += 1
                continue
            text = row.get(key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                rejected[f"no string field '{key}'"] += 1
                continue
            docs.append(Document(f"{Path(path).name}:{i}", text=text))
    return docs


def list_documents(ccfg, rejected: Counter) -> list[Document]:
    """Every candidate document of the corpus, in sorted order. ``rejected`` counts the JSONL
    lines that are no document."""
    source = CorpusSource(ccfg.source)
    if source == CorpusSource.python_stdlib:
        docs = _stdlib_docs()
        where = f"the standard library at {stdlib_dir()}"
    elif source == CorpusSource.text_files:
        docs = _glob_docs(ccfg.glob)
        where = f"corpus.glob={ccfg.glob}"
    else:
        docs = _jsonl_docs(ccfg.path, ccfg.field, rejected)
        where = f"corpus.path={ccfg.path}"
    if not docs:
        why = f" ({rejected_lines(rejected)})" if rejected else ""
        raise BakeError(f"{where}: no documents found{why}; point it at your task text")
    return docs


def rejected_lines(rejected: Counter) -> str:
    total = sum(rejected.values())
    return f"{total} lines skipped: " + ", ".join(f"{n} {why}" for why, n in rejected.items())


def read_document(doc: Document, skipped: Counter, contents: set[str]) -> str | None:
    """The document's text, or None (counted in ``skipped``) when it is not usable text or
    repeats a document read before (the same content never lands in two splits)."""
    data = None  # a file's bytes: its text's UTF-8 encoding, hashed as they are
    if doc.text is not None:
        text = doc.text
    else:
        assert doc.path is not None  # a document is given by its text or by its file
        try:
            data = doc.path.read_bytes()
        except OSError:
            skipped["unreadable"] += 1
            return None
        if b"\x00" in data:  # anywhere: a text file has no NUL byte
            skipped["binary"] += 1
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not UTF-8"] += 1
            return None
    if not text or text.isspace():  # (strip() would copy a long text)
        skipped["empty"] += 1
        return None
    raw = data if data is not None else text.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).hexdigest()
    if digest in contents:
        skipped["duplicate content"] += 1
        return None
    contents.add(digest)
    return text


def largest(ccfg) -> int:
    """Bytes a corpus holds at once while it is read, from the file system alone: its largest
    document file (read whole), or a JSONL file's size (every line's text is kept)."""
    if CorpusSource(ccfg.source) == CorpusSource.jsonl:
        return Path(ccfg.path).expanduser().stat().st_size
    sizes = (d.path.stat().st_size for d in list_documents(ccfg, Counter()) if d.path)
    return max(sizes, default=0)
