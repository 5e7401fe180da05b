"""The recipe in plain torch, written from the reference (skillbake.rs), for tests only.

It imports nothing of bake: a Llama forward from the raw weight tensors (RMSNorm, rotary
embedding, grouped-query causal attention, the SwiGLU FFN with a gate on the input of
down_proj), the looped variant (virtual layer v runs physical layer v % n, pass-major, the
final norm between passes), and one step of each phase with the reference's loss, its global
norm clip and a hand-written Adam. Attention is run without gradient, as the recipe does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class TinyLlama:
    """The tiny model's weights as plain tensors, read from a transformers state dict."""

    def __init__(self, state: dict, config, loops: int = 1, loop_norm: bool = True):
        self.w = {k: v.detach().clone() for k, v in state.items()}
        self.layers = config.num_hidden_layers
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.hidden = config.hidden_size
        self.head_dim = self.hidden // self.heads
        self.eps = config.rms_norm_eps
        self.theta = config.rope_parameters["rope_theta"]
        self.loops, self.loop_norm = loops, loop_norm
        self.head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def ffn(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        p = f"model.layers.{i}.mlp."
        return (
            self.w[p + "gate_proj.weight"],
            self.w[p + "up_proj.weight"],
            self.w[p + "down_proj.weight"],
        )

    def rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, t: int):
        half = self.head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def attention(self, i: int, x):
        p = f"model.layers.{i}.self_attn."
        b, t, _ = x.shape
        q = (x @ self.w[p + "q_proj.weight"].T).view(b, t, self.heads, self.head_dim)
        k = (x @ self.w[p + "k_proj.weight"].T).view(b, t, self.kv_heads, self.head_dim)
        v = (x @ self.w[p + "v_proj.weight"].T).view(b, t, self.kv_heads, self.head_dim)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = self.rope(q, t), self.rope(k, t)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        return out @ self.w[p + "o_proj.weight"].T

    def logits(self, ids, gates=None, ffn: dict | None = None):
        """Logits [batch, seq, vocab]; ``gates`` one row per virtual layer; ``ffn`` physical
        layer -> (gate, up, down) weights replacing the model's."""
        h = self.w["model.embed_tokens.weight"][ids]
        n = self.layers
        for v in range(n * self.loops):
            i = v % n
            p = f"model.layers.{i}."
            h = h + self.attention(i, self.rms(h, self.w[p + "input_layernorm.weight"]))
            x = self.rms(h, self.w[p + "post_attention_layernorm.weight"])
            wg, wu, wd = (ffn or {}).get(i) or self.ffn(i)
            act = F.silu(x @ wg.T) * (x @ wu.T)
            if gates is not None:
                act = act * gates[v]
            h = h + act @ wd.T
            if self.loop_norm and i == n - 1 and v < n * self.loops - 1:
                h = self.rms(h, self.w["model.norm.weight"])
        return self.rms(h, self.w["model.norm.weight"]) @ self.head.T

    def ce(self, ids, gates=None, ffn=None):
        """Mean next-token cross-entropy over positions 1..t (the recipe's training loss)."""
        logits = self.logits(ids, gates, ffn)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def clip(grads: list[torch.Tensor], max_norm: float = 1.0) -> list[torch.Tensor]:
    """The reference's global-norm clip: scale by max_norm / norm when norm > max_norm."""
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    scale = max_norm / norm if norm > max_norm else 1.0
    return [g * scale for g in grads]


class Adam:
    """The reference's Adam (betas 0.9/0.999, eps 1e-8, bias-corrected, no weight decay)."""

    def __init__(self, params: list[torch.Tensor], lr: float):
        self.lr, self.t = lr, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    def step(self, params, grads, lr_scale: float = 1.0) -> list[torch.Tensor]:
        self.t += 1
        bc1, bc2 = 1 - 0.9**self.t, 1 - 0.999**self.t
        out = []
        for p, g, m, v in zip(params, grads, self.m, self.v, strict=True):
            m.mul_(0.9).add_(0.1 * g)
            v.mul_(0.999).add_(0.001 * g * g)
            out.append(p - self.lr * lr_scale * (m / bc1) / ((v / bc2).sqrt() + 1e-8))
        return out


class Sgd:
    """SGD with momentum 0.9 (the buffer starts at the first gradient, no dampening)."""

    def __init__(self, params: list[torch.Tensor], lr: float):
        self.lr = lr
        self.buf: list[torch.Tensor | None] = [None for _ in params]

    def step(self, params, grads, lr_scale: float = 1.0) -> list[torch.Tensor]:
        out = []
        for k, (p, g) in enumerate(zip(params, grads, strict=True)):
            b = self.buf[k]
            self.buf[k] = g.clone() if b is None else 0.9 * b + g
            out.append(p - self.lr * lr_scale * self.buf[k])
        return out


class Adafactor:
    """Adafactor for matrices (Shazeer & Stern 2018) with an absolute learning rate and no
    momentum: second-moment decay 1 - t^-0.8, eps1 1e-30 on the squared gradient, the row and
    column means of it as the factors, update RMS clipped to 1."""

    def __init__(self, params: list[torch.Tensor], lr: float):
        self.lr, self.t = lr, 0
        self.rows = [torch.zeros(p.shape[0], dtype=p.dtype) for p in params]
        self.cols = [torch.zeros(p.shape[1], dtype=p.dtype) for p in params]

    def step(self, params, grads, lr_scale: float = 1.0) -> list[torch.Tensor]:
        self.t += 1
        beta = 1.0 - self.t**-0.8
        out = []
        for p, g, r, c in zip(params, grads, self.rows, self.cols, strict=True):
            sq = g * g + 1e-30
            r.mul_(beta).add_((1 - beta) * sq.mean(dim=1))
            c.mul_(beta).add_((1 - beta) * sq.mean(dim=0))
            v = torch.outer(r / r.mean(), c)  # the factored estimate of E[g^2]
            u = g / v.sqrt()
            u = u / max(1.0, float(u.pow(2).mean().sqrt()))
            out.append(p - self.lr * lr_scale * u)
        return out


def mask_init_logit(loops: int) -> float:
    """sigma(m0) ** loops == sigma(2.0)."""
    per_visit = (1 / (1 + math.exp(-2.0))) ** (1 / loops)
    return math.log(per_visit / (1 - per_visit))


def phase_a(model: TinyLlama, calib, logits, steps, lr, l1_init, l1_step, eval_every):
    """Phase A's steps with the sigmoid gate: CE + l1 / (inter * physical layers) * sum sigma,
    the L1 weight grown by l1_step after the update of every evaluation step."""
    opt, l1 = Adam([logits], lr), l1_init
    inter = logits.shape[1]
    for s in range(steps):
        m = logits.detach().clone().requires_grad_()
        loss = model.ce(calib[s % calib.shape[0]][None], torch.sigmoid(m))
        loss = loss + l1 / (inter * model.layers) * torch.sigmoid(m).sum()
        (grad,) = torch.autograd.grad(loss, m)
        (logits,) = opt.step([logits], clip([grad]))
        if (s + 1) % eval_every == 0:
            l1 += l1_step
    return logits


def phase_b(model: TinyLlama, calib, gates, layers, steps, lr, optimizer=Adam, block=0):
    """Phase B's steps: the FFN copies of ``layers`` under the hard ``gates``, cosine learning
    rate divided by the loop depth, one shared clip over every trained tensor. With ``block``
    > 0 the layers train in groups of ``block``, bottom first, the steps split evenly, each
    group alone with its own cosine and a fresh optimiser."""
    copies = {i: [w.clone() for w in model.ffn(i)] for i in layers}
    groups = [layers[k : k + block] for k in range(0, len(layers), block)] if block else [layers]
    bounds = [round(g * steps / len(groups)) for g in range(len(groups))] + [steps]
    for g, group in enumerate(groups):
        flat = [w for i in group for w in copies[i]]
        opt, n = optimizer(flat, lr), bounds[g + 1] - bounds[g]
        for k, s in enumerate(range(bounds[g], bounds[g + 1])):
            params = [w.detach().clone().requires_grad_() for w in flat]
            ffn = {**copies, **{i: params[3 * j : 3 * j + 3] for j, i in enumerate(group)}}
            loss = model.ce(calib[s % calib.shape[0]][None], gates, ffn)
            grads = torch.autograd.grad(loss, params)
            scale = 0.5 * (1 + math.cos(math.pi * k / n)) / model.loops
            flat = opt.step(flat, clip(list(grads)), scale)
            copies.update({i: flat[3 * j : 3 * j + 3] for j, i in enumerate(group)})
    return copies


def top_keep(logits, sparsity: float):
    """The controller's structure without alignment: the highest logits over all rows, at most
    floor((1 - sparsity) * all) of them (ties: the lower position stays)."""
    flat = logits.flatten()
    budget = math.floor((1.0 - sparsity) * flat.numel() + 1e-9)
    order = torch.sort(-flat, stable=True).indices
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order[:budget]] = True
    return keep.view_as(logits)


def joint_phase_a(model: TinyLlama, calib, logits, steps, lr, ffn_lr, target, ramp, l1, eval_every):
    """Phase A that trains every layer's FFN copies with the mask: the hard structure at the
    sparsity ramped from 0 to ``target`` over ``ramp`` of the steps (straight-through: the
    sigmoid's gradient), CE + L1 on sigma(m); the logits with their own clip and Adam at ``lr``,
    the weights with theirs at ``ffn_lr``, cosine over the steps and divided by the loop depth.
    ``l1`` = (init, step): the weight grows by ``step`` after every evaluation step."""
    inter, n = logits.shape[1], model.layers
    flat = [w.clone() for i in range(n) for w in model.ffn(i)]
    opt_m, opt_w = Adam([logits], lr), Adam(flat, ffn_lr)
    weight = l1[0]
    for s in range(steps):
        end = ramp * steps
        sp = target if end <= 0 or s >= end else target * s / end
        m = logits.detach().clone().requires_grad_()
        params = [w.detach().clone().requires_grad_() for w in flat]
        sig = torch.sigmoid(m)
        gates = top_keep(m.detach(), sp).to(m.dtype) + sig - sig.detach()
        ffn = {i: params[3 * i : 3 * i + 3] for i in range(n)}
        loss = model.ce(calib[s % calib.shape[0]][None], gates, ffn)
        loss = loss + weight / (inter * n) * sig.sum()
        grads = torch.autograd.grad(loss, [m, *params])
        (logits,) = opt_m.step([logits], clip([grads[0]]))
        scale = 0.5 * (1 + math.cos(math.pi * s / steps)) / model.loops
        flat = opt_w.step(flat, clip(list(grads[1:])), scale)
        if (s + 1) % eval_every == 0:
            weight += l1[1]
    return logits, {i: flat[3 * i : 3 * i + 3] for i in range(n)}
