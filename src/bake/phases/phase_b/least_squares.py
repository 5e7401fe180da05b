"""Closed-form repair: a least-squares reconstruction of every pruned layer's ``down_proj``.

For each virtual layer, in order, over the calibration chunks: the FFN's activations ``a`` of
the PRUNED model's own input (the repaired layers below it included) are gathered into a Gram
matrix G = sum a a^T, and the kept columns of ``down_proj`` are solved for a target ``t``:

    W'[:, K] = R[:, K] (G[K, K] + lambda I)^-1,  R = sum t a^T,  lambda = ridge * mean diag G[K, K]

(the normal equations of min ||W'[:, K] a_K - t||^2), with the target

    t = W a(x_p) + drift * ((x_o + W a(x_o)) - (x_p + W a(x_p)))

x_p and x_o being the pruned and the UNPRUNED residual streams after the layer's attention.
``drift`` (``phase_b.ls_drift``) is how much of the drift the layers below left this layer
undoes: 0 reconstructs the layer itself (the kept neurons reproduce the whole FFN on the input
it now gets), 1 makes the pruned stream rejoin the unpruned one after the layer. Between them
is best measured (SmolLM2 at 20%, held-out: 9.85 at 0, 9.69 at 1, 9.64 at 0.5).

On Gemma's layers the FFN output passes a norm before the residual add; the stream is not
linear in ``down_proj`` there, and drift 0 is used. The repaired layer feeds the next one. On a
looped model a physical layer's ``down_proj`` serves every visit, each with its own gates: the
visits' normal equations are summed (each visit's gates restricting the kept columns), and the
solution is refreshed at every visit with what is known by then.

One forward pass over the calibration set computes only what the solve needs. Each layer's FFN
is permuted so that its kept neurons come first: the Gram matrix is that of the kept columns
(G[K, K], its blocks on and above the diagonal multiplied, the rest mirrored), the cross sums
R = sum t a_K^T are formed from the target itself (drift > 0) or as W_K G[K, K] + W_D G[D, K]
(drift 0, from the dropped-by-kept block), and the repaired layer computes its kept neurons
only. The unpruned stream (drift > 0) is read from the file FLAP's statistics pass wrote
(:mod:`bake.phases.stream`) when there is one, else run beside the pruned one. Sums are formed
in float32 per batch and added in float64; the solve is a float64 Cholesky.

With ``select`` (``phase_a=reconstruction``) each layer's kept neurons are chosen from the same
equations before its solve (:func:`choose`): the width stays the one that ships, the neurons are
those whose repair leaves the least error, and the layers above see the chosen structure.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from bake.models import loader
from bake.models.stack import FfnOverride, Stack
from bake.phases import ship
from bake.phases import stream as streams
from bake.phases.phase_b.repaired import Repaired, restore_values, save_values
from bake.phases.stream import Reader
from bake.phases.structure import compute_keep
from bake.ranks import rank_name
from bake.storage.cache import digest
from bake.storage.files import atomic_write
from bake.tracking.console import Progress

if TYPE_CHECKING:
    from bake.phases.context import RunContext
    from bake.phases.structure import Keep

log = logging.getLogger("bake")

FfnWeights = tuple[Tensor, Tensor, Tensor]


class _Normal:
    """The accumulated normal equations of one physical layer: M W'^T = R^T."""

    def __init__(self, kept: Tensor, hidden: int, dtype=torch.float64):
        self.kept = kept  # indices of the physical layer's kept neurons
        k = kept.numel()
        self.m = torch.zeros(k, k, dtype=dtype)
        self.r = torch.zeros(hidden, k, dtype=dtype)

    def add(self, gram: Tensor, cross: Tensor, gate: Tensor) -> None:
        """One visit's Gram matrix [kept, kept] and target cross sums [hidden, kept] over the
        kept columns (float64), with its gates on them [kept]."""
        d = gate.to(gram.dtype)
        self.m += d[:, None] * gram * d[None, :]
        self.r += cross * d[None, :]

    def solve(self, ridge: float) -> Tensor:
        """The kept columns of the new ``down_proj`` [hidden, kept]."""
        a = self.m.clone()
        a.diagonal().add_(_ridge(self.m.diagonal(), ridge))
        chol = torch.linalg.cholesky(a)
        return torch.cholesky_solve(self.r.T.contiguous(), chol).T


class _Gram:
    """sum a^T a over batches for the first ``k`` columns of ``a`` [tokens, width] (float64),
    and, with ``rest``, the other columns against them (sum a_D^T a_K, [width - k, k]).

    The Gram matrix is symmetric: only its blocks on and above the diagonal are multiplied
    (``blocks`` bands of columns: (blocks + 1) / (2 blocks) of the products), per batch into
    float32 parts, then added in float64; :meth:`full` mirrors them. Parts and sums are views of
    ``scratch`` (float32 and float64, ``width`` ^ 2 each), buffers that serve every layer: no
    blocks of a layer's sizes are allocated and freed (they fragment the C heap on CPU)."""

    def __init__(
        self, k: int, width: int, rest: bool, scratch: tuple[Tensor, Tensor], blocks: int = 4
    ):
        self.k = k
        step = -(-k // blocks) if k else 1
        self.bands = [(i, min(i + step, k)) for i in range(0, k, step)]
        pairs = [(i, j) for i in range(len(self.bands)) for j in range(i, len(self.bands))]
        shapes = [
            (b - a, d - c) for (a, b), (c, d) in ((self.bands[i], self.bands[j]) for i, j in pairs)
        ]
        if rest and width > k:
            shapes.append((width - k, k))
        flat32, flat64 = scratch
        self.device = flat64.device
        flat64[: sum(r * c for r, c in shapes)].zero_()
        views32, views64, at = [], [], 0
        for r, c in shapes:
            views32.append(flat32[at : at + r * c].view(r, c))
            views64.append(flat64[at : at + r * c].view(r, c))
            at += r * c
        self.blocks = list(zip(pairs, views32[: len(pairs)], views64[: len(pairs)], strict=True))
        self.rest: Tensor | None = views64[-1] if len(shapes) > len(pairs) else None
        self.rest_part = views32[-1] if self.rest is not None else None

    def add(self, a: Tensor) -> None:
        """One batch's activations [tokens, width] (the kept columns first)."""
        for (i, j), part, total in self.blocks:
            (r0, r1), (c0, c1) = self.bands[i], self.bands[j]
            total += torch.mm(a[:, r0:r1].T, a[:, c0:c1], out=part)
        if self.rest is not None:
            self.rest += torch.mm(a[:, self.k :].T, a[:, : self.k], out=self.rest_part)

    def full(self) -> Tensor:
        """The Gram matrix of the first ``k`` columns [k, k], float64."""
        g = torch.empty(self.k, self.k, dtype=torch.float64, device=self.device)
        for (i, j), _, total in self.blocks:
            (r0, r1), (c0, c1) = self.bands[i], self.bands[j]
            g[r0:r1, c0:c1] = total
            if i != j:
                g[c0:c1, r0:r1] = total.T
        return g


def choose(gram: Tensor, cross: Tensor, width: int, ridge: float) -> Tensor:
    """The ``width`` neurons whose least-squares repair leaves the least error: sorted indices
    [width], by greedy removal (Optimal Brain Surgeon on the layer's normal equations, as ZipLM
    does for structures).

    With the Gram matrix G (ridged as :meth:`_Normal.solve` ridges it) and the target's cross
    sums R, the repaired weights on a kept set K are W = R[:, K] G[K, K]^-1, and the error they
    leave grows, when neuron j leaves K and the others are solved again, by exactly
    ||W[:, j]||^2 / (G[K, K]^-1)[j, j]. Each step removes the neuron of the least growth and
    updates W and the inverse by that neuron's rank-one correction (no new solve); float64.
    """
    n = gram.shape[0]
    if not 0 < width <= n:
        raise ValueError(f"width={width}: not in [1, {n}]")
    g = gram.to(torch.float64).clone()
    diag = g.diagonal()
    diag.add_(_ridge(diag, ridge))
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(g))
    del g
    w = cross.to(torch.float64) @ hinv  # [hidden, n]
    alive = torch.ones(n, dtype=torch.bool, device=gram.device)
    inf = torch.tensor(math.inf, dtype=torch.float64, device=gram.device)
    for _ in range(n - width):
        growth = torch.where(alive, (w * w).sum(dim=0) / hinv.diagonal(), inf)
        j = int(torch.argmin(growth))
        col, wj = hinv[:, j].clone(), w[:, j].clone()
        scale = -1.0 / float(col[j])
        w.addr_(wj, col, alpha=scale)
        hinv.addr_(col, col, alpha=scale)
        alive[j] = False
    return torch.nonzero(alive).squeeze(1)


def _ridge(diag: Tensor, ridge: float) -> float:
    """What the solve adds to the Gram matrix's diagonal: ``ridge`` times its mean, and a
    last-bits floor that keeps an all-zero column solvable."""
    if not diag.numel():
        return 0.0
    return ridge * float(diag.mean()) + 1e-12 * max(float(diag.max()), 1.0)


@torch.inference_mode()
def least_squares(
    stack: Stack,
    calib: Tensor,
    visits: Tensor,
    physical: Tensor,
    ridge: float = 1e-3,
    batch: int = 8,
    drift: float = 0.5,
    base: FfnOverride | None = None,
    downs: Sequence[Tensor] | None = None,
    select: bool = False,
    unpruned: Reader | None = None,
) -> dict[int, FfnWeights]:
    """Repaired FFN weights of every physical layer (gate, up unchanged; ``down_proj`` with its
    kept columns solved and its dropped columns zero), from one pass over ``calib`` [n, seq].

    ``visits`` [num_virtual, inter] and ``physical`` [num_layers, inter] are the keep masks
    that ship (bool); ``drift`` in [0, 1] (see the module docstring). ``base``: the FFN
    weights of the UNPRUNED model to reconstruct, where they are not the backbone's (a Phase A
    that trained them); gate and up stay those. ``downs``: one tensor per physical layer that
    its solved ``down_proj`` is written into (new ones when None); on a model that does not
    loop they may be the backbone's own ``down_proj`` (each is read for the last time before its
    layer's solution overwrites it), never on a looped one (its later passes read them).
    ``select``: each layer keeps as many neurons as ``visits`` says, chosen by :func:`choose`;
    ``visits`` and ``physical`` are rewritten in place with the chosen ones (a model that does
    not loop). ``unpruned``: the unpruned model's stream after every layer on these chunks, read
    instead of computed (:mod:`bake.phases.stream`; the backbone's, so ``base`` is None).
    """
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift={drift}: not in [0, 1]")
    stream = drift > 0 and not stack.sandwich
    device = stack.device
    n = calib.shape[0]
    first = stack.embed(calib[:batch].to(device))
    h = first.new_empty(n, *first.shape[1:])  # filled in place: never a second copy of it
    h[: first.shape[0]] = first
    for i in range(batch, n, batch):
        h[i : i + batch] = stack.embed(calib[i : i + batch].to(device))
    del first
    if unpruned is not None and (base is not None or not stream):
        raise ValueError("least_squares: the stream read is the backbone's, for drift > 0")
    h_o = h.clone() if stream and unpruned is None else None  # the unpruned stream
    ropes, amasks = stack.positions(h[:1])
    inter = stack.inter
    # A layer's equations exist from its first visit to its last: one layer's at a time on a
    # model that does not loop, every layer's from the second pass on a looped one.
    normals: dict[int, _Normal] = {}
    out: dict[int, FfnWeights] = {}
    layers = range(stack.num_layers)
    if downs is None:
        downs = [torch.zeros_like(stack.ffn_weights(li)[2]) for li in layers]
    if stack.loops > 1 and any(downs[li] is stack.ffn_weights(li)[2] for li in layers):
        raise ValueError("least_squares: a looped model's down_proj cannot take the solution")
    if select and stack.loops > 1:
        raise ValueError("least_squares: neurons are chosen on a model that does not loop")
    # the per-batch cross sums in float32, added into the float64 ones: a buffer reused across
    # batches (as many short-lived blocks of these sizes fragment the C heap on CPU)
    part_x = h.new_empty(stack.hidden_size * inter) if stream else None
    scratch = (h.new_empty(inter * inter), h.new_empty(inter * inter, dtype=torch.float64))
    wg0, _, wd0 = stack.ffn_weights(0)
    buf_g, buf_u, buf_d = torch.empty_like(wg0), torch.empty_like(wg0), torch.empty_like(wd0)
    last = stack.num_virtual - 1
    with Progress("[LS] least squares", stack.num_virtual, "layers", log) as progress:
        for v in range(stack.num_virtual):
            li = v % stack.num_layers
            wg, wu, wd = base[li] if base is not None and li in base else stack.ffn_weights(li)
            # the columns solved for: the layer's kept neurons (every neuron when they are
            # chosen here), first in a permuted copy of the FFN, so that their activations are
            # a leading block and the repaired layer computes only them
            cols = torch.arange(inter) if select else torch.nonzero(physical[li]).squeeze(1)
            k = cols.numel()
            dropped = torch.ones(inter, dtype=torch.bool)
            dropped[cols] = False
            order = torch.cat([cols, torch.nonzero(dropped).squeeze(1)]).to(device)
            pg = torch.index_select(wg, 0, order, out=buf_g)  # the permuted FFN, in buffers
            pu = torch.index_select(wu, 0, order, out=buf_u)
            pd = torch.index_select(wd, 1, order, out=buf_d)
            sums = _Gram(k, inter, not stream, scratch, blocks=1 if select else 4)
            cross = torch.zeros(stack.hidden_size, k, dtype=torch.float64, device=device)
            part = part_x[: cross.numel()].view(cross.shape) if part_x is not None else None
            for i in range(0, n, batch):
                x = stack.attend(li, h[i : i + batch], ropes, amasks)
                h[i : i + batch] = x
                a = stack.activations(stack.ffn_input(li, x), pg, pu)
                a2 = a.reshape(-1, inter)
                sums.add(a2)
                if stream:  # the target t = W a + drift * (the drift W a leaves)
                    if unpruned is not None:
                        after = unpruned.read(v, i, min(i + batch, n), x)
                    else:
                        assert h_o is not None
                        x_o = stack.attend(li, h_o[i : i + batch], ropes, amasks)
                        y_o = F.linear(stack.activations(stack.ffn_input(li, x_o), wg, wu), wd)
                        after = h_o[i : i + batch] = x_o + y_o
                    t = (after - x).mul_(drift)
                    if drift < 1.0:
                        t.add_(F.linear(a, pd), alpha=1.0 - drift)
                    t2 = t.reshape(-1, stack.hidden_size)
                    cross += torch.mm(t2.T, a2[:, :k], out=part)
            gram = sums.full()
            if not stream:  # t = W a: R = W G over the kept columns, W_K G_KK + W_D G_DK
                cross = pd[:, :k].detach().double() @ gram
                if sums.rest is not None:
                    cross += pd[:, k:].detach().double() @ sums.rest
            del sums
            gate = visits[v].to(device, h.dtype)
            if select:
                chosen = choose(gram, cross, int(visits[v].sum()), ridge).cpu()
                visits[v] = physical[li] = False
                visits[v, chosen] = physical[li, chosen] = True
                gate = visits[v].to(device, h.dtype)
                gram, cross = gram[chosen][:, chosen], cross[:, chosen]
                cols = chosen
            if li not in normals:
                normals[li] = _Normal(cols, stack.hidden_size)
            normals[li].add(gram.cpu(), cross.cpu(), gate[cols.to(device)].cpu())
            del gram, cross
            solved = normals[li].solve(ridge).to(device, wd.dtype)  # [hidden, kept]
            down = downs[li].zero_()
            kept = cols.to(device)
            down[:, kept] = solved
            if v + stack.num_layers > last:  # no later visit of this layer adds to its equations
                del normals[li]
            out[li] = (wg, wu, down)
            kg, ku, d = pg[:k], pu[:k], gate[kept]  # the kept neurons lead the permuted copy
            if select:  # chosen after the copy was made: their rows, in the buffers' heads
                kg = torch.index_select(wg, 0, kept, out=buf_g[: kept.numel()])
                ku = torch.index_select(wu, 0, kept, out=buf_u[: kept.numel()])
            for i in range(0, n, batch):  # the repaired layer: its kept neurons only
                x = h[i : i + batch]
                a = stack.activations(stack.ffn_input(li, x), kg, ku).mul_(d)
                h[i : i + batch] = x + stack.ffn_output(li, F.linear(a, solved))
            if stack.loop_norm and li == stack.num_layers - 1 and v < last:
                h = stack.norm(h)
                if h_o is not None:
                    h_o = stack.norm(h_o)
            progress.advance()
    return out


def run(ctx: RunContext, keep: Keep, start: Repaired) -> Repaired:
    """The closed-form repair of every layer's ``down_proj`` (``phase_b.least_squares``),
    computed once per run directory (a resumed bake reads it back).

    On the default path (a model that does not loop, no FFN trained by Phase A, no
    distillation) the solution is written over the backbone's ``down_proj`` tensors, whose
    values are saved first and restored when the repair is not kept: no second set of them is
    held through least squares, Phase B and the export. A looped model's later passes read the
    unpruned ``down_proj``, and distillation's teacher is the backbone: separate tensors there.

    With ``phase_a=reconstruction`` the pass also chooses each layer's neurons (:func:`choose`):
    the returned Repaired carries that structure (``keep``) when the repair is kept; when it is
    not, Phase A's structure and weights go on.
    """

    ls, distill = ctx.settings.least_squares, ctx.settings.phase_b.distill
    select = ctx.settings.phase_a.least_squares_chooses
    if not ls.enabled:
        return start.unchanged({"enabled": False})
    if bool(keep.visits.all()):  # no neuron removed: nothing to reconstruct (the dense row)
        log.info("[LS] least-squares repair: skipped, no neuron was removed")
        return start.unchanged({"enabled": True, "skipped": "nothing pruned"})
    t0 = time.perf_counter()
    stack = ctx.model.stack
    path = ctx.run_dir / "checkpoints" / "least_squares.safetensors"
    mask = keep.visits.to(torch.uint8).flatten()
    saved, chosen = _read_downs(path, mask, stack.num_layers)
    if stack.sandwich and ls.drift > 0:
        log.warning(
            "phase_b.ls_drift=%s is not used by this model's layers (a norm after the FFN, as "
            "Gemma's): each layer's repair reconstructs the layer itself (drift 0)",
            ls.drift,
        )
    layers = range(stack.num_layers)
    in_place = start.ffn is None and distill == 0 and stack.loops == 1
    originals = ctx.run_dir / "checkpoints" / f"least_squares_start.{rank_name()}.safetensors"
    if in_place:
        loader.forget(ctx.model)  # a later bake in this process must load the backbone anew
        downs = [stack.ffn_weights(li)[2] for li in layers]
        save_values(originals, downs)
    elif saved is not None:  # a resumed bake's solution, read as it is
        downs = saved
    else:  # made outside inference mode: Phase B may train them in place
        downs = [torch.zeros_like(stack.ffn_weights(li)[2]) for li in layers]
    stream = streams.of_run(ctx)
    if saved is None:
        chosen, physical = keep.visits.clone(), keep.physical.clone()
        ready = stream is not None and start.ffn is None and stream.ready()
        reader = Reader(stream) if ready and stream is not None else None
        if reader is not None:
            log.info(
                "[LS] the unpruned model's stream: read from the statistics pass (%.2f GB)",
                reader.stream.nbytes / 1e9,
            )
        try:
            least_squares(
                stack,
                ctx.corpus.calib[: ls.chunks],
                chosen,
                physical,
                ls.ridge,
                drift=ls.drift,
                base=start.ffn,
                downs=downs,
                select=select,
                unpruned=reader,
            )
        finally:
            if reader is not None:
                reader.close()
        _save_downs(path, downs, mask, chosen)
    elif in_place:
        with torch.no_grad():
            for d, value in zip(downs, saved, strict=True):
                d.copy_(value)
        del saved
    if stream is not None:  # read, or not needed any more: its gigabytes of disk go back
        stream.path.unlink(missing_ok=True)
    base = start.ffn or {}  # gate and up stay those the repair started from
    ffn = {li: (*(base.get(li) or stack.ffn_weights(li))[:2], downs[li]) for li in layers}
    assert chosen is not None  # read back with the solution, or just chosen
    repaired = compute_keep(chosen, keep.alive, stack.num_layers) if select else keep
    held = ctx.held_figures(repaired.visits, ffn)
    ppl, kl = held.ppl, held.kl
    key = ctx.settings.phase_b.key  # the figure that keeps it (phase_b.select)
    kept = ship.keeps(held.figure(key), start.figure(key))
    if in_place:
        if not kept:
            restore_values(downs, originals)
        originals.unlink(missing_ok=True)
    info: dict[str, object] = {
        "enabled": True,
        "held_ppl": ppl,
        **({} if kl is None else {"held_kl": kl, "held_top1": held.top1}),
        "improved": kept,
        "chunks": int(min(ls.chunks, ctx.corpus.calib.shape[0])),
        "seconds": time.perf_counter() - t0,
    }
    if select:
        swapped = int((repaired.visits & ~keep.visits).sum())
        info["chosen_by_reconstruction"] = {"swapped": swapped, "shipped": kept}
        log.info(
            "[LS] neurons chosen by reconstruction: %d of the %d kept are not Phase A's",
            swapped,
            int(keep.visits.sum()),
        )
    verdict = "kept: below" if kept else "not kept: not below"
    if kl is None:
        log.info("[LS] least-squares repair: held-PPL %.3f (%s %.3f)", ppl, verdict, start.ppl)
    else:
        log.info(
            "[LS] least-squares repair: held-out KL %.4g (%s %.4g), held-PPL %.3f (%.3f before)",
            kl,
            verdict,
            start.figure(key),
            ppl,
            start.ppl,
        )
    if not kept:
        return start.unchanged(info)
    return Repaired(ffn, ppl, info, repaired if select else None, kl)


def _read_downs(path, mask, layers: int) -> tuple[list | None, Tensor | None]:
    """A run's saved least-squares solution and the structure it solved for (the one it
    started from, or the one it chose), when it was made from this keep mask."""
    from safetensors.torch import load_file  # lazy: safetensors

    if not path.is_file():
        return None, None
    saved = load_file(path)
    if saved.get("mask") is None or digest(saved["mask"].tolist()) != digest(mask.tolist()):
        return None, None
    chosen = saved.get("chosen", saved["mask"]).bool().view(-1, saved["down.0"].shape[1])
    return [saved[f"down.{li}"] for li in range(layers)], chosen


def _save_downs(path, downs: list, mask, chosen: Tensor) -> None:
    """The repaired ``down_proj`` weights of a run and the structure they were solved for, for
    its resume (atomic)."""
    from safetensors.torch import save_file  # lazy: safetensors

    tensors = {f"down.{li}": d.detach().cpu() for li, d in enumerate(downs)}
    extra = {"mask": mask.cpu(), "chosen": chosen.to(torch.uint8).flatten().cpu()}
    with atomic_write(path) as tmp:
        save_file(tensors | extra, str(tmp))
