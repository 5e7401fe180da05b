"""The unpruned model's residual stream after every layer's FFN, on disk, for one bake.

FLAP's statistics run the unpruned model over the calibration chunks; least squares' target
(``phase_b.ls_drift`` > 0) needs that same model's stream after each layer on the first
``phase_b.ls_chunks`` of them, and would otherwise run it a second time, beside the pruned
stream. The statistics pass writes it here (float32, one block per virtual layer, each chunk's
rows in order); least squares reads it batch by batch and deletes it. It is never held in
memory: a layer's block for SmolLM2's 240 chunks is 141 MB, the file 4.2 GB.

The file is written under a temporary name and renamed when the pass is complete; least squares
uses it only when its size is the one its shape gives, else computes the stream itself (as it
does when the statistics came from the cache, or the file would not fit on the disk).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bake.ranks import rank_name

if TYPE_CHECKING:
    from bake.phases.context import RunContext

log = logging.getLogger("bake")

DISK_SHARE = 0.5  # the file is written only when it takes at most this share of the free disk


@dataclass(frozen=True)
class Stream:
    """Where the stream of ``chunks`` calibration chunks of ``seq`` tokens lies, and its shape."""

    path: Path
    layers: int  # virtual layers
    chunks: int
    seq: int
    hidden: int

    @property
    def nbytes(self) -> int:
        return self.layers * self.chunks * self.seq * self.hidden * 4

    def _offset(self, v: int, chunk: int) -> int:
        return ((v * self.chunks + chunk) * self.seq * self.hidden) * 4

    def ready(self) -> bool:
        """Whether a complete file of this shape is there."""
        return self.path.is_file() and self.path.stat().st_size == self.nbytes


class Writer:
    """Writes a :class:`Stream` into ``path`` (a temporary file that
    :func:`bake.storage.files.atomic_write` renames into place) as the statistics pass goes."""

    def __init__(self, stream: Stream, path: Path):
        self.stream = stream
        self.file = open(path, "wb")  # noqa: SIM115 (closed by the pass, before the rename)
        self.file.truncate(stream.nbytes)

    def record(self, v: int, h: Tensor, start: int) -> None:
        """Layer ``v``'s stream ``h`` [batch, seq, hidden] of the batch from chunk ``start``."""
        s = self.stream
        rows = h[: max(0, s.chunks - start)]
        if not rows.shape[0]:
            return
        self.file.seek(s._offset(v, start))
        rows = rows.detach().to("cpu", torch.float32).contiguous()  # as it is, on CPU in fp32
        self.file.write(memoryview(rows.numpy()).cast("B"))  # type: ignore[arg-type]


class Reader:
    """Reads a layer's rows of a complete :class:`Stream`, batch by batch."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.file = open(stream.path, "rb")  # noqa: SIM115 (closed by close)
        self._buffer: Tensor | None = None  # one batch's rows, reused (no block per read)

    def read(self, v: int, start: int, stop: int, like: Tensor) -> Tensor:
        """Chunks [start, stop) of layer ``v`` [stop - start, seq, hidden], on ``like``'s
        device and dtype; on CPU in fp32, a view of a buffer the next read overwrites."""
        s = self.stream
        need = (stop - start) * s.seq * s.hidden
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=torch.float32)
        out = self._buffer[:need].view(stop - start, s.seq, s.hidden)
        self.file.seek(s._offset(v, start))
        got = self.file.readinto(memoryview(out.numpy()).cast("B"))  # type: ignore[arg-type]
        if got != need * 4:
            raise OSError(f"{s.path}: {got} of {need * 4} bytes read (the file is short)")
        return out.to(like.device, like.dtype)

    def close(self) -> None:
        self.file.close()


def of_run(ctx: RunContext) -> Stream | None:
    """The stream this bake's least squares would read, when its target needs the unpruned
    model (drift > 0 on a model without a norm after the FFN) and that model is the backbone
    (a training-free Phase A); None otherwise."""
    s, stack = ctx.settings, ctx.model.stack
    ls = s.least_squares
    if not ls.enabled or ls.drift <= 0 or stack.sandwich or s.phase_a.trains:
        return None
    if s.phase_a.target_sparsity <= 0:
        return None
    calib = ctx.corpus.calib
    chunks = int(min(ls.chunks, calib.shape[0]))
    path = ctx.run_dir / "checkpoints" / f"unpruned_stream.{rank_name()}.f32"
    return Stream(path, stack.num_virtual, chunks, int(calib.shape[1]), stack.hidden_size)


def fits(stream: Stream) -> bool:
    """Whether writing ``stream`` leaves most of the disk free (:data:`DISK_SHARE`)."""
    folder = stream.path.parent
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if stream.nbytes <= DISK_SHARE * free:
        return True
    log.info(
        "[LS] the unpruned stream (%.1f GB) is not written beside the statistics (%.1f GB "
        "free): least squares computes it",
        stream.nbytes / 1e9,
        free / 1e9,
    )
    return False
