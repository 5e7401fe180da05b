"""bake's own forward over a Llama-style decoder: virtual layers, per-visit FFN gates, frozen
attention, and a next-token loss that never holds the full-vocabulary logits of a batch.

A looped model runs its physical layers ``loops`` times with shared weights: virtual layer
``v`` runs physical layer ``v % num_layers``, pass-major. With ``loop_norm`` the residual
stream is replaced by its final-norm output at each boundary BETWEEN passes; the last pass ends
with the ordinary final norm, once, before the head.

Attention runs under ``no_grad``: its output is a constant of the backward, so the gradient
walks the residual stream through the FFN chain only (the recipe's gradient, and what makes a
step cheap: no attention activations are kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from bake.models import families

LOGIT_BUDGET = 1 << 22  # elements of one logits block (16 MiB in fp32): rows = budget // vocab
FfnOverride = Mapping[int, Sequence[Tensor]]  # physical layer -> (gate, up, down) weights
Observer = Callable[[int, Tensor], None]


class Stack:
    """A view of a Hugging Face causal LM that bake runs layer by layer.

    The model's weights are shared, never copied; bake's phases hold only their own trainable
    tensors (mask logits, FFN copies) and pass them to :meth:`hidden`.

    The layer's anatomy is its family's (:class:`bake.models.families.Family`): the norm the FFN
    reads its input through, the norms on the attention and FFN outputs before their residual
    adds (Gemma's four norms), the FFN's activation, per-layer RoPE bases when the rotary
    module takes a layer type (Gemma 3), and a sliding causal mask for every layer whose
    attention window is shorter than the sequence.
    """

    def __init__(self, lm, loops: int = 1, loop_norm: bool = True):
        self.lm = lm.requires_grad_(False)  # the backbone is frozen: no weight gradients, ever
        core = lm.model
        self.embed = core.embed_tokens
        self.layers = list(core.layers)
        self.norm = core.norm
        self.rotary = core.rotary_emb
        self.head = lm.lm_head
        self.loops = int(loops)
        self.loop_norm = bool(loop_norm)
        self.num_layers = len(self.layers)
        self.inter = self.layers[0].mlp.gate_proj.out_features
        self.hidden_size = self.embed.weight.shape[1]
        self.vocab = self.head.weight.shape[0]
        config = lm.config
        family = families.get(getattr(config, "model_type", None), "bake's forward")
        raw = config.to_dict()
        self.act = family.activation(raw)
        self.windows = family.layer_windows(raw, self.num_layers)
        self.ffn_norm = family.norm_before_ffn
        self.attn_out_norm = family.norm_after_attention
        self.ffn_out_norm = family.norm_after_ffn
        self.sandwich = family.sandwich  # the FFN output is normed before the residual add
        types = getattr(config, "layer_types", None)
        by_type = family.rope_by_layer_type and bool(types)
        self.rope_types: list[str] | None = list(types or ()) if by_type else None
        self._masks: dict[tuple, list[Tensor | None]] = {}
        # trainer.activation_checkpointing: a training forward keeps each layer's input only
        # and recomputes the layer's FFN in the backward
        self.checkpoint = False
        if getattr(config, "_attn_implementation", "sdpa") != "sdpa":
            lm.set_attn_implementation("sdpa")  # causal without a mask tensor

    @property
    def num_virtual(self) -> int:
        return self.num_layers * self.loops

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def ffn_weights(self, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        mlp = self.layers[layer].mlp
        return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    # -- the parts of a layer, shared by the forward, the repair and the statistics -----------
    def positions(self, h: Tensor) -> tuple[list, list[Tensor | None]]:
        """Per physical layer: the rotary (cos, sin) and the attention mask (None: causal)
        for sequences shaped like ``h`` [batch, seq, hidden]."""
        t = h.shape[1]
        pos = torch.arange(t, device=h.device).unsqueeze(0)
        if self.rope_types is None:
            rope = self.rotary(h, pos)
            ropes = [rope] * self.num_layers
        else:
            by_type = {k: self.rotary(h, pos, layer_type=k) for k in set(self.rope_types)}
            ropes = [by_type[k] for k in self.rope_types]
        return ropes, self.attention_masks(t, h.device)

    def attention_masks(self, t: int, device: torch.device) -> list[Tensor | None]:
        """Per physical layer, the boolean mask of a sliding layer whose window is shorter
        than ``t`` (query q sees key k when k <= q and q - k < window, as transformers'
        sliding mask), else None (full causal attention, SDPA's own)."""
        key = (t, str(device))
        if key not in self._masks:
            q = torch.arange(t, device=device)[:, None]
            k = torch.arange(t, device=device)[None, :]
            made: dict[int, Tensor] = {}
            out: list[Tensor | None] = []
            for w in self.windows:
                if w is None or w >= t:
                    out.append(None)
                    continue
                if w not in made:
                    made[w] = ((k <= q) & (q - k < w))[None, None]
                out.append(made[w])
            self._masks = {key: out}  # one sequence length at a time
        return self._masks[key]

    def attend(self, li: int, h: Tensor, ropes: list, amasks: list) -> Tensor:
        """The residual stream after layer ``li``'s attention block (no gradient: frozen)."""
        layer = self.layers[li]
        with torch.no_grad():
            a = layer.self_attn(
                layer.input_layernorm(h), position_embeddings=ropes[li], attention_mask=amasks[li]
            )[0]
            if self.attn_out_norm is not None:
                a = getattr(layer, self.attn_out_norm)(a)
        return h + a

    def ffn_input(self, li: int, h: Tensor) -> Tensor:
        """The normed residual stream the FFN of layer ``li`` reads."""
        return getattr(self.layers[li], self.ffn_norm)(h)

    def ffn_output(self, li: int, y: Tensor) -> Tensor:
        """What the FFN adds to the residual stream: ``down_proj``'s output, normed by the
        post-feedforward norm on Gemma."""
        if self.ffn_out_norm is None:
            return y
        return getattr(self.layers[li], self.ffn_out_norm)(y)

    def activations(self, x: Tensor, wg: Tensor, wu: Tensor) -> Tensor:
        """The input of ``down_proj``: act(gate_proj x) * up_proj x (no gradient, in place)."""
        return activate(self.act, F.linear(x, wg), inplace=True).mul_(F.linear(x, wu))

    def _ffn(
        self,
        li: int,
        x: Tensor,
        gate: Tensor | None,
        ffn: FfnOverride | None,
        observe: Observer | None,
        v: int,
    ) -> Tensor:
        wg, wu, wd = ffn[li] if ffn is not None and li in ffn else self.ffn_weights(li)
        if observe is not None or not torch.is_grad_enabled():  # in place: no backward
            act = self.activations(x, wg, wu)
            if observe is not None:
                observe(v, act)
            return F.linear(act if gate is None else act.mul_(gate), wd)
        if gate is None:
            gate = torch.ones((), dtype=x.dtype, device=x.device)
        return _GatedFFN.apply(x, wg, wu, wd, gate, self.act)

    def _ffn_block(
        self,
        li: int,
        h: Tensor,
        gate: Tensor | None,
        ffn: FfnOverride | None,
        v: int,
        observe: Observer | None = None,
    ) -> Tensor:
        """The residual stream after layer ``li``'s FFN, from the stream after its attention."""
        return h + self.ffn_output(li, self._ffn(li, self.ffn_input(li, h), gate, ffn, observe, v))

    def hidden(
        self,
        ids: Tensor,
        gates: Tensor | Sequence[Tensor | None] | None = None,
        ffn: FfnOverride | None = None,
        observe: Observer | None = None,
        after: Observer | None = None,
    ) -> Tensor:
        """Final-norm hidden states [batch, seq, hidden] of ``ids`` [batch, seq].

        Args:
            gates: one row per virtual layer ([num_virtual, inter] or a sequence of rows, None
                for an open row), multiplying the input of ``down_proj``; None: all open.
            ffn: trained (gate, up, down) weights replacing physical layers' FFN.
            observe: called with (virtual layer, FFN activations before the gate).
            after: called with (virtual layer, the residual stream after its FFN, before a
                loop's norm).
        """
        with torch.no_grad():
            h = self.embed(ids)
            ropes, amasks = self.positions(h)
        last = self.num_virtual - 1
        for v in range(self.num_virtual):
            li = v % self.num_layers
            h = self.attend(li, h, ropes, amasks)
            row = None if gates is None else gates[v]
            if self.checkpoint and observe is None and torch.is_grad_enabled():
                h = checkpoint(self._ffn_block, li, h, row, ffn, v, use_reentrant=False)
            else:
                h = self._ffn_block(li, h, row, ffn, v, observe)
            if after is not None:
                after(v, h)
            if self.loop_norm and li == self.num_layers - 1 and v < last:
                h = self.norm(h)
        return self.norm(h)

    def nll(self, ids: Tensor, gates=None, ffn: FfnOverride | None = None) -> tuple[Tensor, int]:
        """Summed next-token NLL of ``ids`` and the number of scored positions (no gradient)."""
        hn = self.hidden(ids, gates, ffn)
        rows = hn[:, :-1].reshape(-1, hn.shape[-1])
        return _nll_sum(rows, self.head.weight, ids[:, 1:].reshape(-1)), rows.shape[0]

    def loss(self, ids: Tensor, gates=None, ffn: FfnOverride | None = None) -> Tensor:
        """Mean next-token cross-entropy of ``ids`` [batch, seq], differentiable w.r.t. the
        hidden states (the head is frozen): the recipe's training loss."""
        hn = self.hidden(ids, gates, ffn)
        rows = hn[:, :-1].reshape(-1, hn.shape[-1])
        return _HeadCrossEntropy.apply(rows, self.head.weight, ids[:, 1:].reshape(-1))

    def distill_loss(
        self,
        ids: Tensor,
        alpha: float,
        gates=None,
        ffn: FfnOverride | None = None,
        teacher_ffn: FfnOverride | None = None,
    ) -> Tensor:
        """(1 - alpha) * cross-entropy + alpha * KL(teacher || student), per position, mean:
        the student is this stack with ``gates`` and ``ffn``, the teacher this stack with every
        neuron and ``teacher_ffn`` (None: the unpruned backbone) on the same chunk (no
        gradient)."""
        with torch.no_grad():
            teacher = self.hidden(ids, None, teacher_ffn)[:, :-1].reshape(-1, self.hidden_size)
        hn = self.hidden(ids, gates, ffn)
        rows = hn[:, :-1].reshape(-1, hn.shape[-1])
        targets = ids[:, 1:].reshape(-1)
        return _HeadDistill.apply(rows, teacher, self.head.weight, targets, float(alpha))


# The FFN activations bake reproduces: name -> (forward, d act / d input given the upstream).
def _gelu(approximate: str):
    def fwd(x: Tensor, inplace: bool = False) -> Tensor:
        return F.gelu(x, approximate=approximate)

    def bwd(grad: Tensor, x: Tensor) -> Tensor:
        return torch.ops.aten.gelu_backward(grad, x, approximate=approximate)

    return fwd, bwd


ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "silu": (lambda x, inplace=False: F.silu(x, inplace=inplace), torch.ops.aten.silu_backward),
    "gelu": _gelu("none"),
    "gelu_pytorch_tanh": _gelu("tanh"),
}
ACTIVATIONS["swish"] = ACTIVATIONS["silu"]
ACTIVATIONS["gelu_new"] = ACTIVATIONS["gelu_pytorch_tanh"]  # the same tanh approximation


def activate(name: str, x: Tensor, inplace: bool = False) -> Tensor:
    """The FFN activation ``name`` of ``x``."""
    return ACTIVATIONS[name][0](x, inplace=inplace)


class _GatedFFN(torch.autograd.Function):
    """down(act(gate_proj x) * up_proj x * gate): the FFN with its neuron gate, keeping only the
    two pre-activations for the backward (autograd would keep four tensors of that size per
    layer). The weights get gradients only when they require them (Phase B's copies)."""

    @staticmethod
    def forward(
        ctx, x: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, gate: Tensor, act: str = "silu"
    ) -> Tensor:
        g, u = F.linear(x, wg), F.linear(x, wu)
        a = activate(act, g).mul_(u).mul_(gate)
        out = F.linear(a, wd)
        weights_grad = wg.requires_grad or wu.requires_grad or wd.requires_grad
        ctx.save_for_backward(g, u, gate, wg, wu, wd, x if weights_grad else None)
        ctx.act = act
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        g, u, gate, wg, wu, wd, x = ctx.saved_tensors
        needs = ctx.needs_input_grad
        d2 = dout.reshape(-1, dout.shape[-1])
        da = d2 @ wd  # d(a * gate)
        fwd, bwd = ACTIVATIONS[ctx.act]
        actg = fwd(g).reshape(da.shape)
        act = actg * u.reshape(da.shape)
        dgate = wdgrad = None
        if needs[4]:
            dgate = (da * act).sum(0) if gate.dim() else (da * act).sum()
        if needs[3]:
            wdgrad = d2.T @ (act * gate)
        da.mul_(gate)
        du = da * actg
        dg = bwd(da.mul_(u.reshape(da.shape)), g.reshape(da.shape))
        dx = (dg @ wg).add_(du @ wu).view(*g.shape[:-1], wg.shape[1])
        x2 = None if x is None else x.reshape(-1, x.shape[-1])
        dwg = dg.T @ x2 if needs[1] else None
        dwu = du.T @ x2 if needs[2] else None
        return (dx if needs[0] else None), dwg, dwu, wdgrad, dgate, None


def _head_pass(rows: Tensor, weight: Tensor, targets: Tensor, grad: bool):
    """Per-row -log p(target) of ``rows @ weight.T``, and optionally d(sum)/d(rows), in one
    pass over blocks of the VOCABULARY with a running max (an online logsumexp).

    Each block of the head's weights is read once and every row meets it in one GEMM (row
    blocks would re-read the whole head per block); only a [rows, block] tile of logits exists
    at a time. The gradient softmax @ W is accumulated the same way, rescaled whenever a row's
    running max grows: sum_j exp(l_j - m) W_j / sum_j exp(l_j - m), then minus W[target].
    """
    n, vocab = rows.shape[0], weight.shape[0]
    block = head_blocks(n, vocab)
    dt = torch.promote_types(rows.dtype, torch.float32)  # bf16 evaluations reduce in fp32
    m = torch.full((n,), -math.inf, dtype=dt, device=rows.device)
    s = torch.zeros(n, dtype=dt, device=rows.device)
    picked = torch.zeros(n, dtype=dt, device=rows.device)
    acc = torch.zeros(n, rows.shape[1], dtype=rows.dtype, device=rows.device) if grad else None
    for j0 in range(0, vocab, block):
        w = weight[j0 : j0 + block].to(rows.dtype)  # a head stored in bf16: upcast per block
        logits = (rows @ w.T).to(dt)
        here = ((targets >= j0) & (targets < j0 + block)).nonzero().squeeze(1)
        picked[here] = logits[here, targets[here] - j0]
        m_new = torch.maximum(m, logits.amax(dim=1))
        scale = torch.exp(m - m_new)
        probs = logits.sub_(m_new[:, None]).exp_()
        s = s * scale + probs.sum(dim=1)
        if acc is not None:
            acc.mul_(scale[:, None].to(acc.dtype)).addmm_(probs.to(acc.dtype), w)
        m = m_new
    nll = m + s.log() - picked
    if acc is None:
        return nll, None
    return nll, acc.div_(s[:, None].to(acc.dtype)).sub_(weight[targets].to(acc.dtype))


def _nll_sum(rows: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Sum of -log p(target) over rows (float64), never holding all the logits."""
    return _head_pass(rows, weight, targets, grad=False)[0].sum(dtype=torch.float64)


class _HeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``rows @ weight.T`` against ``targets``.

    The gradient w.r.t. the rows, (softmax - onehot) @ weight / N, is formed in the forward
    pass over vocabulary blocks, so neither the logits nor a log-softmax copy exist whole; the
    backward only scales it. The head weight is frozen in both phases.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        nll, grad = _head_pass(rows, weight, targets, grad=True)
        ctx.save_for_backward(grad)
        ctx.n = rows.shape[0]
        return (nll.sum(dtype=torch.float64) / ctx.n).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * (grad_out / ctx.n), None, None


def head_blocks(n: int, vocab: int) -> int:
    """The vocabulary block of a head pass over ``n`` rows: at most LOGIT_BUDGET logits."""
    return min(vocab, max(1024, LOGIT_BUDGET // max(n, 1)))


def _lse(rows: Tensor, weight: Tensor, dt: torch.dtype) -> Tensor:
    """Per-row logsumexp of ``rows @ weight.T`` over vocabulary blocks (online)."""
    n, vocab = rows.shape[0], weight.shape[0]
    block = head_blocks(n, vocab)
    m = torch.full((n,), -math.inf, dtype=dt, device=rows.device)
    s = torch.zeros(n, dtype=dt, device=rows.device)
    for j0 in range(0, vocab, block):
        logits = (rows @ weight[j0 : j0 + block].to(rows.dtype).T).to(dt)
        m_new = torch.maximum(m, logits.amax(dim=1))
        s = s * torch.exp(m - m_new) + logits.sub_(m_new[:, None]).exp_().sum(dim=1)
        m = m_new
    return m + s.log()


class _HeadDistill(torch.autograd.Function):
    """Mean over rows of (1 - alpha) * CE(student, target) + alpha * KL(teacher || student),
    both distributions from the frozen head, over vocabulary blocks: a first pass finds each
    side's logsumexp, a second forms the loss and its gradient w.r.t. the student's rows,
    (alpha * (p_s - p_t) + (1 - alpha) * (p_s - onehot)) @ weight / N. No [rows, vocab]
    tensor exists whole."""

    @staticmethod
    def forward(ctx, rows, teacher, weight, targets, alpha):
        dt = torch.promote_types(rows.dtype, torch.float32)
        n, vocab = rows.shape[0], weight.shape[0]
        lse_s, lse_t = _lse(rows, weight, dt), _lse(teacher, weight, dt)
        block = head_blocks(n, vocab)
        kl = torch.zeros(n, dtype=dt, device=rows.device)
        picked = torch.zeros(n, dtype=dt, device=rows.device)
        grad = torch.zeros_like(rows)
        for j0 in range(0, vocab, block):
            w = weight[j0 : j0 + block].to(rows.dtype)
            log_s = (rows @ w.T).to(dt).sub_(lse_s[:, None])
            log_t = (teacher @ w.T).to(dt).sub_(lse_t[:, None])
            here = ((targets >= j0) & (targets < j0 + block)).nonzero().squeeze(1)
            picked[here] = log_s[here, targets[here] - j0]
            p_t = log_t.exp()
            kl += (p_t * (log_t - log_s)).sum(dim=1)
            g = log_s.exp_().sub_(p_t, alpha=alpha)  # p_s - alpha * p_t
            grad.addmm_(g.to(grad.dtype), w)
        grad.sub_(weight[targets].to(grad.dtype), alpha=1.0 - alpha).div_(n)
        ctx.save_for_backward(grad)
        loss = (1.0 - alpha) * (-picked) + alpha * kl
        return (loss.sum(dtype=torch.float64) / n).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad * grad_out, None, None, None, None


def autocast_for(device: torch.device, precision: str):
    """The autocast context of an evaluation in ``precision``, as resolved by
    :func:`bake.phases.settings.resolve_precision` (the precision rule): bf16 autocast on CUDA,
    else none (fp32)."""
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


@torch.inference_mode()
def held_nll(
    stack: Stack,
    chunks: Tensor,
    gates=None,
    ffn: FfnOverride | None = None,
    batch_size: int = 12,
    precision: str = "fp32",
) -> tuple[float, int]:
    """Summed NLL and scored positions of ``chunks`` [n, seq], in batches of ``batch_size``."""
    total, count = 0.0, 0
    device = stack.device
    with autocast_for(device, precision):
        for i in range(0, chunks.shape[0], batch_size):
            ids = chunks[i : i + batch_size].to(device, non_blocking=True)
            nll, n = stack.nll(ids, gates, ffn)
            total += float(nll)
            count += n
    return total, count


def perplexity(nll: float, count: int) -> float:
    """exp(mean NLL); inf when the mean overflows."""
    try:
        return math.exp(nll / max(count, 1))
    except OverflowError:
        return math.inf
