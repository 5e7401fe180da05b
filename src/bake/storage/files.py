"""Writes that are never left half-done (a temporary sibling, renamed into place at the end), and
tensors written to a safetensors file one at a time."""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yield a temporary file path beside ``path``; rename it to ``path`` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if tmp.exists():  # mkstemp makes it private; the result is as any file the user writes
            tmp.chmod(0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; it replaces ``path`` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result should not be
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def staged(target_dir: Path, last: str) -> Iterator[Path]:
    """Yield a staging directory inside ``target_dir``; on success move each entry into
    ``target_dir`` (replacing what is there), ``last`` at the very end, so that ``last``
    marks a complete set. On failure nothing of the staging directory remains."""
    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging.", dir=target_dir))
    try:
        yield tmp
        names = sorted(p.name for p in tmp.iterdir())
        (target_dir / last).unlink(missing_ok=True)  # the old marker never vouches for new files
        for name in [n for n in names if n != last] + ([last] if last in names else []):
            dest = target_dir / name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(tmp / name, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


Producer = Callable[[], "Tensor"]  # makes one tensor when it is written


def save_streaming(path: Path, tensors: list[tuple[str, tuple, Producer]], metadata: dict) -> None:
    """Write fp32 tensors in the safetensors format one at a time (the library's writer would
    first serialise all of them into memory)."""

    import torch  # lazy: torch

    header, offset = {}, 0
    for name, shape, _ in tensors:
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, make in tensors:
            t = make().detach().to("cpu", torch.float32).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, header says {shape}")
            fh.write(t.numpy().data.cast("B"))
