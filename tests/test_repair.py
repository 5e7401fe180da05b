"""The least-squares repair against an independent sequential implementation (plain torch on
the reference's forward, tests/reference_recipe.py), on one and two loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_recipe import TinyLlama
from test_phase_a import tiny

from bake.phases import ship, structure
from bake.phases.phase_b import least_squares as repair

pytestmark = pytest.mark.slow  # seconds per case: the repair and its reference, layer by layer


def solved_error(gram, cross, kept, lam: float) -> float:
    """The error the ridged least squares on the neurons ``kept`` leaves, solved from scratch,
    up to the target's constant: -tr(R_K (G_KK + lam I)^-1 R_K^T)."""
    kept = list(kept)
    g = gram[kept][:, kept] + lam * torch.eye(len(kept), dtype=gram.dtype)
    r = cross[:, kept]
    return -float((r * torch.linalg.solve(g, r.T).T).sum())


def greedy_by_resolving(gram, cross, width: int, lam: float) -> list[int]:
    """Brute-force greedy removal: at each step every remaining neuron is tried out by solving
    the ridged least squares of the others from scratch (:func:`solved_error`); the one whose
    removal leaves the least error goes."""
    alive = list(range(gram.shape[0]))
    while len(alive) > width:
        drop = min(
            alive, key=lambda j: solved_error(gram, cross, [x for x in alive if x != j], lam)
        )
        alive.remove(drop)
    return alive


def independent_repair(
    ref: TinyLlama, calib, keep_visits, ridge: float, drift: float = 0.0, select: bool = False
):
    """Layer by layer, in order, on the pruned model's own stream: min over the kept columns of
    sum over visits and tokens of ||W'[:, K] (g_v a_K) - t||^2, plus ridge * mean diag, with
    t = W a + drift * (the unpruned stream after the layer - the pruned one after attention -
    W a): the unpruned model run alongside, from the same embedding. ``select`` (one loop):
    each layer's kept set, as wide as ``keep_visits`` says, is chosen first by
    :func:`greedy_by_resolving` on the whole layer's equations (ridge times the mean diagonal of
    the full Gram matrix); ``keep_visits`` is rewritten with the choice."""
    n = ref.layers
    h = ref.w["model.embed_tokens.weight"][calib]
    h_o = h.clone()
    physical = keep_visits.view(ref.loops, n, -1).any(dim=0)
    normal = {i: [0, 0] for i in range(n)}
    solved = {}
    for v in range(n * ref.loops):
        i = v % n
        p = f"model.layers.{i}."
        h = h + ref.attention(i, ref.rms(h, ref.w[p + "input_layernorm.weight"]))
        x = ref.rms(h, ref.w[p + "post_attention_layernorm.weight"])
        wg, wu, wd = ref.ffn(i)
        a = (F.silu(x @ wg.T) * (x @ wu.T)).reshape(-1, wg.shape[0])
        h_o = h_o + ref.attention(i, ref.rms(h_o, ref.w[p + "input_layernorm.weight"]))
        x_o = ref.rms(h_o, ref.w[p + "post_attention_layernorm.weight"])
        h_o = h_o + (F.silu(x_o @ wg.T) * (x_o @ wu.T)) @ wd.T  # the unpruned model, unchanged
        own = a @ wd.T  # the whole unpruned FFN on the same input
        target_t = own + drift * ((h_o - h).reshape(-1, h.shape[-1]) - own)
        if select:
            gram, cross = a.T @ a, target_t.T @ a
            lam = ridge * float(gram.diagonal().mean())
            chosen = greedy_by_resolving(gram, cross, int(keep_visits[v].sum()), lam)
            keep_visits[v] = False
            keep_visits[v, chosen] = True
            physical[i] = keep_visits[v]
        k = physical[i].nonzero().squeeze(1)
        b = a[:, k] * keep_visits[v, k].to(a.dtype)  # what the kept columns see on this visit
        normal[i][0] = normal[i][0] + b.T @ b
        normal[i][1] = normal[i][1] + target_t.T @ b
        m, r = normal[i]
        lam = ridge * m.diagonal().mean()
        cols = torch.linalg.solve(m + lam * torch.eye(len(k), dtype=m.dtype), r.T).T
        down = torch.zeros_like(wd)
        down[:, k] = cols
        solved[i] = down
        gate = keep_visits[v].to(a.dtype)
        h = h + ((F.silu(x @ wg.T) * (x @ wu.T)) * gate) @ down.T
        if ref.loop_norm and i == n - 1 and v < n * ref.loops - 1:
            h = ref.rms(h, ref.w["model.norm.weight"])
            h_o = ref.rms(h_o, ref.w["model.norm.weight"])
    return solved


@pytest.mark.parametrize("drift", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("loops", [1, 2])
def test_least_squares_equals_an_independent_sequential_solution(loops, drift):
    stack = tiny(loops=loops)
    g = torch.Generator().manual_seed(3)
    calib = torch.randint(0, 256, (5, 24), generator=g)
    keep = torch.rand(stack.num_virtual, stack.inter, generator=g) > 0.35
    physical = keep.view(loops, 3, -1).any(dim=0)
    got = repair.least_squares(stack, calib, keep, physical, 1e-3, 2, drift=drift)
    ref = TinyLlama(stack.lm.state_dict(), stack.lm.config, loops, stack.loop_norm)
    want = independent_repair(ref, calib, keep, 1e-3, drift)
    for i in range(3):
        torch.testing.assert_close(got[i][2], want[i], rtol=1e-6, atol=1e-7)
        dropped = ~keep.view(loops, 3, -1).any(dim=0)[i]
        assert got[i][2][:, dropped].abs().max() == 0  # dropped columns are gone
        assert (got[i][2] - stack.ffn_weights(i)[2]).abs().max() > 1e-3  # and kept ones moved


def test_the_two_targets_differ_once_the_stream_has_drifted():
    stack = tiny()
    g = torch.Generator().manual_seed(5)
    calib = torch.randint(0, 256, (5, 24), generator=g)
    keep = torch.rand(3, stack.inter, generator=g) > 0.35
    a = repair.least_squares(stack, calib, keep, keep, 1e-3, 2, drift=0.0)
    b = repair.least_squares(stack, calib, keep, keep, 1e-3, 2, drift=1.0)
    torch.testing.assert_close(a[0][2], b[0][2], rtol=1e-5, atol=1e-6)  # no drift before layer 0
    assert (a[2][2] - b[2][2]).abs().max() > 1e-4


def test_nothing_pruned_gives_back_the_original_weights():
    stack = tiny()
    calib = torch.randint(0, 256, (12, 24), generator=torch.Generator().manual_seed(4))  # 288 > 128
    keep = torch.ones(3, stack.inter, dtype=torch.bool)
    got = repair.least_squares(stack, calib, keep, keep, 1e-10, 2, drift=0.0)
    for i in range(3):
        torch.testing.assert_close(got[i][2], stack.ffn_weights(i)[2], rtol=1e-5, atol=1e-6)


@pytest.mark.bake
@pytest.mark.parametrize("kept", [True, False])
def test_least_squares_in_place_ships_its_solution_or_the_backbone(
    tmp_path, docs_dir, monkeypatch, kept
):
    """On the default path least squares writes its solution over the backbone's down_proj:
    a kept repair ships the solution the run saved for its resume, one that is not kept ships
    exactly what the same bake ships without least squares; the saved originals are removed."""
    from conftest import last_run, report, run_bake, tiny_args
    from safetensors.torch import load_file

    base = ["phase_a=flap", "phase_b.enabled=false", "tracking.enabled=false"]
    choose = structure.select_repair if kept else (lambda ppls, baseline: None)
    monkeypatch.setattr(ship, "select_repair", choose)  # the owner's keep-or-not
    assert run_bake(tiny_args(tmp_path / "ls", docs_dir, *base, "phase_b.least_squares=true")) == 0
    run = last_run(tmp_path / "ls")
    assert report(run)["least_squares"]["improved"] is kept
    assert not list((run / "checkpoints").glob("least_squares_start*"))
    # the unpruned stream came from FLAP's statistics pass (bake.phases.stream), and is gone
    assert "stream: read from the statistics pass" in (run / "bake.log").read_text()
    assert not list((run / "checkpoints").glob("unpruned_stream*"))
    got = load_file(run / "model" / "model.safetensors")
    if kept:
        solved = load_file(run / "checkpoints" / "least_squares.safetensors")
        physical = load_file(run / "masks.safetensors")["keep"].bool()
        for li in range(physical.shape[0]):
            idx = physical[li].nonzero().squeeze(1)
            want = solved[f"down.{li}"][:, idx]
            assert torch.equal(got[f"model.layers.{li}.mlp.down_proj.weight"], want), li
        return
    off = [*base, "phase_b.least_squares=false"]
    assert run_bake(tiny_args(tmp_path / "off", docs_dir, *off)) == 0
    want = load_file(last_run(tmp_path / "off") / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_choose_is_greedy_removal_by_the_error_the_repair_leaves():
    """The rank-one updates choose what re-solving every candidate from scratch chooses, and
    the choice is near the best of all subsets (brute force over every subset), where keeping
    the largest scores is not: two copies of the strongest neuron carry one's information."""
    import itertools

    g = torch.Generator().manual_seed(7)
    a = torch.randn(64, 10, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2, 10)
    a[:, 8] = a[:, 9] * 1.01  # a near copy of the strongest neuron
    w = torch.randn(6, 10, generator=g, dtype=torch.float64)
    w[:, 8] = w[:, 9]
    gram, cross = a.T @ a, w @ a.T @ a  # drift 0: the target is the layer's own output
    ridge, width = 1e-3, 6
    lam = ridge * float(gram.diagonal().mean())
    got = repair.choose(gram, cross, width, ridge).tolist()
    assert got == sorted(greedy_by_resolving(gram, cross, width, lam))

    def error(kept) -> float:
        return solved_error(gram, cross, kept, lam)

    total = float(torch.einsum("hn,nm,hm->", w, gram, w))  # ||W a||^2: the error's constant
    best = min(itertools.combinations(range(10), width), key=error)
    score = (w * w).sum(0) * gram.diagonal()  # ||W[:, j]||^2 ||a_j||^2, a score's choice
    top = sorted(torch.topk(score, width).indices.tolist())
    assert {8, 9} <= set(top) and not {8, 9} <= set(got)  # one copy is enough
    assert total + error(got) <= 1.05 * (total + error(best))
    assert total + error(got) < 0.9 * (total + error(top))


def test_least_squares_chooses_the_neurons_an_independent_greedy_chooses():
    """select=True against plain torch: each layer, on the pruned stream the layers below (as
    chosen and repaired) leave it, keeps the neurons brute-force greedy removal keeps, at the
    width it was given, and solves for them."""
    stack = tiny()
    g = torch.Generator().manual_seed(11)
    calib = torch.randint(0, 256, (4, 24), generator=g)
    given = torch.rand(3, stack.inter, generator=g) > 0.1
    visits, physical = given.clone(), given.clone()
    got = repair.least_squares(stack, calib, visits, physical, 1e-3, 2, drift=0.5, select=True)
    ref = TinyLlama(stack.lm.state_dict(), stack.lm.config, 1, stack.loop_norm)
    want_keep = given.clone()
    want = independent_repair(ref, calib, want_keep, 1e-3, 0.5, select=True)
    assert torch.equal(visits, want_keep) and torch.equal(physical, want_keep)
    assert torch.equal(visits.sum(1), given.sum(1))  # the widths it was given
    assert not torch.equal(visits, given)  # and other neurons than it was given
    for i in range(3):
        torch.testing.assert_close(got[i][2], want[i], rtol=1e-6, atol=1e-7)


@pytest.mark.bake
@pytest.mark.parametrize("kept", [True, False])
def test_reconstruction_ships_the_neurons_least_squares_chose_or_flaps(
    tmp_path, docs_dir, monkeypatch, kept
):
    """phase_a=reconstruction: a kept repair ships the neurons the least-squares pass chose, at
    FLAP's widths (the masks file, the solution its resume reads, the stock model's down_proj);
    one not kept ships exactly what phase_a=flap ships without least squares."""
    from conftest import last_run, report, run_bake, tiny_args
    from safetensors.torch import load_file

    base = ["phase_b.enabled=false", "tracking.enabled=false"]
    choose = structure.select_repair if kept else (lambda ppls, baseline: None)
    monkeypatch.setattr(ship, "select_repair", choose)  # the owner's keep-or-not
    args = tiny_args(tmp_path / "rec", docs_dir, "phase_a=reconstruction", *base)
    assert run_bake(args) == 0
    flap = [*base, "phase_a=flap", "phase_b.least_squares=false"]
    assert run_bake(tiny_args(tmp_path / "flap", docs_dir, *flap)) == 0
    run, flap_run = last_run(tmp_path / "rec"), last_run(tmp_path / "flap")
    info = report(run)["least_squares"]
    assert info["improved"] is kept and info["chosen_by_reconstruction"]["shipped"] is kept
    got = load_file(run / "model" / "model.safetensors")
    want = load_file(flap_run / "model" / "model.safetensors")
    ships = load_file(run / "masks.safetensors")["keep"].bool()
    flaps = load_file(flap_run / "masks.safetensors")["keep"].bool()
    if not kept:
        assert torch.equal(ships, flaps) and got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        return
    solved = load_file(run / "checkpoints" / "least_squares.safetensors")
    assert torch.equal(solved["chosen"].bool().view_as(ships), ships)
    assert torch.equal(ships.sum(1), flaps.sum(1))  # FLAP's widths
    swapped = int((ships & ~flaps).sum())
    assert swapped == info["chosen_by_reconstruction"]["swapped"] > 0  # other neurons
    for li in range(ships.shape[0]):
        idx = ships[li].nonzero().squeeze(1)
        down = got[f"model.layers.{li}.mlp.down_proj.weight"]
        assert torch.equal(down, solved[f"down.{li}"][:, idx]), li
        # gate_proj keeps the backbone's rows of the chosen neurons: those FLAP also kept are
        # the rows FLAP's export holds for them
        name = f"model.layers.{li}.mlp.gate_proj.weight"
        mine = dict(zip(idx.tolist(), got[name], strict=True))
        theirs = dict(zip(flaps[li].nonzero().squeeze(1).tolist(), want[name], strict=True))
        for j in (ships[li] & flaps[li]).nonzero().squeeze(1).tolist():
            assert torch.equal(mine[j], theirs[j]), (li, j)


@pytest.mark.parametrize("loops", [1, 2])
def test_least_squares_reads_the_unpruned_stream_the_statistics_pass_wrote(tmp_path, loops):
    """FLAP's statistics pass writes the unpruned model's stream after every layer on the first
    chunks (bake.phases.stream); least squares reads it instead of running that model again,
    and solves what the independent sequential implementation solves."""
    from bake.phases.phase_a import scores
    from bake.phases.stream import Reader, Stream

    stack = tiny(loops=loops)
    g = torch.Generator().manual_seed(7)
    calib = torch.randint(0, 256, (7, 24), generator=g)
    keep = torch.rand(stack.num_virtual, stack.inter, generator=g) > 0.35
    physical = keep.view(loops, 3, -1).any(dim=0)
    stream = Stream(tmp_path / "stream.f32", stack.num_virtual, 5, 24, stack.hidden_size)
    scores.activation_stats(stack, calib, batch=2, stream=stream)  # 7 chunks, 5 written
    assert stream.ready() and not list(tmp_path.glob(".stream.f32.*"))  # no temporary left
    reader = Reader(stream)
    got = repair.least_squares(
        stack, calib[:5], keep.clone(), physical.clone(), 1e-3, 2, drift=0.5, unpruned=reader
    )
    reader.close()
    ref = TinyLlama(stack.lm.state_dict(), stack.lm.config, loops, stack.loop_norm)
    want = independent_repair(ref, calib[:5], keep, 1e-3, 0.5)
    for i in range(3):
        torch.testing.assert_close(got[i][2], want[i], rtol=1e-5, atol=1e-6)  # fp32 rounding
