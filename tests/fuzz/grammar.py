"""The fuzzer's program grammar: a spec is plain JSON data, ``build(spec)`` its module.

A spec::

    {"seed": 3, "b": 2, "s": 8, "d": 16, "ops": [op, ...], "out": out_op}

Every op maps the hidden stream ``h: [b, s, d]`` to a tensor of the same shape
(so ops compose freely); ``out`` maps it to what the model returns. Op kinds
(``kind`` key) and their fields:

    lowrank   d -> r -> d bottleneck: style linear|flinear|matmul, r, bias_down, bias_up,
              mid silu|gelu|relu|none|mulc (c)
    dense     nn.Linear(d, d) (bias)
    act       out-of-place element-wise: fn silu|gelu|relu|tanh|mulc (c)
    inplace   in-place on the activation: fn mul_|relu_|silu_|relu_mod|add_ (c)
    norm      how rms_mod|ln_mod|f_rms|f_ln|written|written_f32, affine, heads (0 = over d,
              H = view to [b, s, H, d/H] and normalise over the head dim)
    attn      attention: H, kv (GQA kv heads, repeat_interleave), proj lowrank|dense, r,
              causal, rope, qk_norm (a norm spec or null), style sdpa|manual, view shape|neg
    rope      per-head rotation (cat of halves) of h viewed [b, s, H, d/H]: H
    slice     split h in two along dim 1 (seq) or 2 (hidden): how chunk|split|index, k,
              fn applied to the first part, swap the parts in the cat
    reduce    h + c * h.sum/mean(dim, keepdim) (unsqueezed back when not keepdim)
    where     how where|masked_fill|masked_fill_, mask buf_sd|buf_d|buf_bsd|arange_d, c
    cast      how float|f64|type_as
    autofn    a custom autograd.Function (x * c, backward g * c)
    res       residual around body [ops]: style add|none, or in place on the body's output
              y: iadd (y += h), add_ (y.add_(h)), alias_iadd (a = y; a += h), view_iadd
              (y.view(-1, d) += h), or on the stream: iadd_h (h += y)
    ckpt      torch.utils.checkpoint(use_reentrant=False) around body [ops]
    gb        torch._dynamo.graph_break()

    out: how h|lowrank|dense|sum_last|mean_seq (lowrank/dense widen to d_out)
    gain: the output times a scalar parameter

Parameters are drawn from ``torch.manual_seed(spec["seed"])`` in construction
order, inputs and loss weights from generators seeded from it: both ranks (and
the reference) build bit-identical programs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

Spec = dict[str, Any]

EPS = 1e-5


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------


def _act(name: str, x: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    if name == "tanh":
        return torch.tanh(x)
    if name == "mulc":
        return x * c
    if name == "none":
        return x
    raise ValueError(name)


def _raw(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / math.sqrt(shape[0] if len(shape) > 1 else 1))


class LowRank(nn.Module):
    """``up(mid(down(x)))``, ``d_in -> r -> d_out``, in one of three spellings."""

    def __init__(self, op: Spec, d_in: int, d_out: int) -> None:
        super().__init__()
        self.style, self.mid, self.c = op["style"], op["mid"], op.get("c", 1.0)
        r, bd, bu = op["r"], op["bias_down"], op["bias_up"]
        if self.style == "linear":
            self.down = nn.Linear(d_in, r, bias=bd)
            self.up = nn.Linear(r, d_out, bias=bu)
        elif self.style == "flinear":
            self.w_down = nn.Parameter(torch.randn(r, d_in) / math.sqrt(d_in))
            self.b_down = nn.Parameter(0.1 * torch.randn(r)) if bd else None
            self.w_up = nn.Parameter(torch.randn(d_out, r) / math.sqrt(r))
            self.b_up = nn.Parameter(0.1 * torch.randn(d_out)) if bu else None
        else:  # matmul: x @ A, A [d_in, r]
            self.a = nn.Parameter(torch.randn(d_in, r) / math.sqrt(d_in))
            self.a_bias = nn.Parameter(0.1 * torch.randn(r)) if bd else None
            self.b = nn.Parameter(torch.randn(r, d_out) / math.sqrt(r))
            self.b_bias = nn.Parameter(0.1 * torch.randn(d_out)) if bu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "linear":
            return self.up(_act(self.mid, self.down(x), self.c))
        if self.style == "flinear":
            z = _act(self.mid, F.linear(x, self.w_down, self.b_down), self.c)
            return F.linear(z, self.w_up, self.b_up)
        z = x @ self.a
        if self.a_bias is not None:
            z = z + self.a_bias
        y = _act(self.mid, z, self.c) @ self.b
        if self.b_bias is not None:
            y = y + self.b_bias
        return y


def _affine(n: int) -> tuple[nn.Parameter, nn.Parameter]:
    return nn.Parameter(1 + 0.2 * torch.randn(n)), nn.Parameter(0.1 * torch.randn(n))


class Norm(nn.Module):
    """A norm over the last dim of ``[b, s, d]``, or per head over ``[b, s, H, d/H]``."""

    def __init__(self, op: Spec, d: int) -> None:
        super().__init__()
        self.how, self.affine, self.heads = op["how"], op["affine"], op.get("heads", 0)
        n = d // self.heads if self.heads else d
        self.n = n
        if self.how == "rms_mod":
            self.mod = nn.RMSNorm(n, eps=EPS, elementwise_affine=self.affine)
        elif self.how == "ln_mod":
            self.mod = nn.LayerNorm(n, eps=EPS, elementwise_affine=self.affine)
        if self.affine:
            w, bias = _affine(n)
            if self.how in ("rms_mod", "ln_mod"):
                with torch.no_grad():
                    self.mod.weight.copy_(w)
                    if getattr(self.mod, "bias", None) is not None:
                        self.mod.bias.copy_(bias)
            else:
                self.weight = w
                if self.how == "f_ln":
                    self.bias = bias

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self, "weight", None)
        if self.how in ("rms_mod", "ln_mod"):
            return self.mod(x)
        if self.how == "f_rms":
            return F.rms_norm(x, (self.n,), w, EPS)
        if self.how == "f_ln":
            return F.layer_norm(x, (self.n,), w, getattr(self, "bias", None), EPS)
        if self.how == "written":
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        else:  # written_f32, as Llama: compute in fp32, cast back
            xf = x.float()
            y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).type_as(x)
        return y * w if w is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.heads:
            return self.normed(x)
        b, s, d = x.shape
        return self.normed(x.view(b, s, self.heads, d // self.heads)).reshape(b, s, d)


def _rope_tables(s: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Rope(nn.Module):
    def __init__(self, op: Spec, d: int, s: int) -> None:
        super().__init__()
        self.heads = op["H"]
        cos, sin = _rope_tables(s, d // self.heads)
        self.register_buffer("cos", cos[:, None, :], persistent=False)  # [s, 1, hd]
        self.register_buffer("sin", sin[:, None, :], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = x.view(b, s, self.heads, d // self.heads)
        return _rotate(q, self.cos, self.sin).reshape(b, s, d)


def _proj(op: Spec, d_in: int, d_out: int) -> nn.Module:
    if op["proj"] == "dense":
        return nn.Linear(d_in, d_out, bias=op.get("bias", False))
    return LowRank(
        {"style": op.get("style", "linear"), "r": op["r"], "mid": op.get("mid", "none"),
         "bias_down": False, "bias_up": op.get("bias", False)},
        d_in, d_out,
    )  # fmt: skip


class Attention(nn.Module):
    def __init__(self, op: Spec, d: int, s: int) -> None:
        super().__init__()
        self.H, self.kv = op["H"], op["kv"]
        self.hd = d // self.H
        self.causal, self.style, self.view = op["causal"], op["style"], op.get("view", "shape")
        self.q = _proj(op, d, self.H * self.hd)
        self.k = _proj(op, d, self.kv * self.hd)
        self.v = _proj(op, d, self.kv * self.hd)
        self.o = _proj(op, self.H * self.hd, d)
        self.qk_norm = Norm(op["qk_norm"], self.hd) if op.get("qk_norm") else None
        self.rope = op["rope"]
        if self.rope:
            cos, sin = _rope_tables(s, self.hd)
            self.register_buffer("cos", cos, persistent=False)  # [s, hd]
            self.register_buffer("sin", sin, persistent=False)
        if self.style == "manual" and self.causal:
            self.register_buffer(
                "tril", torch.ones(s, s, dtype=torch.bool).tril(), persistent=False
            )

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        if self.view == "neg":
            return t.view(b, s, -1, self.hd).transpose(1, 2)
        return t.view(b, s, n, self.hd).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            self._heads(self.q(x), self.H),
            self._heads(self.k(x), self.kv),
            self._heads(self.v(x), self.kv),
        )
        if self.qk_norm is not None:
            q, k = self.qk_norm.normed(q), self.qk_norm.normed(k)
        if self.rope:
            q, k = _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin)
        if self.kv < self.H:
            k = k.repeat_interleave(self.H // self.kv, dim=1)
            v = v.repeat_interleave(self.H // self.kv, dim=1)
        if self.style == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            att = (q @ k.transpose(-2, -1)) * (self.hd**-0.5)
            if self.causal:
                att = att.masked_fill(~self.tril, float("-inf"))
            o = att.softmax(dim=-1) @ v
        o = o.transpose(1, 2).reshape(b, s, self.H * self.hd)
        return self.o(o)


class _ScaledIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, c: float) -> torch.Tensor:
        ctx.c = c
        return x * c

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.c, None


class Op(nn.Module):
    """One grammar op (the kinds without a module of their own)."""

    def __init__(self, op: Spec, b: int, s: int, d: int) -> None:
        super().__init__()
        self.op = op
        self.kind = op["kind"]
        self.c = float(op.get("c", 1.0))
        if self.kind == "inplace" and op["fn"] == "relu_mod":
            self.relu = nn.ReLU(inplace=True)
        if self.kind == "where" and op["mask"].startswith("buf"):
            g = torch.Generator().manual_seed(op.get("mask_seed", 0))
            shape = {"buf_sd": (s, d), "buf_d": (d,), "buf_bsd": (b, s, d)}[op["mask"]]
            self.register_buffer("mask", torch.rand(shape, generator=g) < 0.3, persistent=False)

    def _mask(self, h: torch.Tensor) -> torch.Tensor:
        if self.op["mask"] == "arange_d":
            return torch.arange(h.shape[-1], device=h.device) % 3 == 1
        return self.mask

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        op, kind, c = self.op, self.kind, self.c
        if kind == "act":
            return _act(op["fn"], h, c)
        if kind == "inplace":
            fn = op["fn"]
            if fn == "mul_":
                return h.mul_(c)
            if fn == "add_":
                return h.add_(c)
            if fn == "relu_":
                return h.relu_()
            if fn == "silu_":
                return F.silu(h, inplace=True)
            return self.relu(h)
        if kind == "slice":
            dim, how = op["dim"], op["how"]
            n = h.shape[dim]
            if how == "chunk":
                a, b = h.chunk(2, dim=dim)
            elif how == "split":
                a, b = h.split([op["k"], n - op["k"]], dim=dim)
            elif dim == 2:
                a, b = h[..., : op["k"]], h[..., op["k"] :]
            else:
                a, b = h[:, : op["k"]], h[:, op["k"] :]
            a = _act(op["fn"], a, c)
            return torch.cat([b, a] if op["swap"] else [a, b], dim=dim)
        if kind == "reduce":
            red = (
                h.sum(op["dim"], keepdim=op["keepdim"])
                if op["op"] == "sum"
                else h.mean(op["dim"], keepdim=op["keepdim"])
            )
            if not op["keepdim"]:
                red = red.unsqueeze(op["dim"])
            return h + c * red
        if kind == "where":
            mask, how = self._mask(h), op["how"]
            if how == "where":
                return torch.where(mask, h, h * c)
            if how == "masked_fill":
                return h.masked_fill(mask, c)
            return h.masked_fill_(mask, c)
        if kind == "cast":
            if op["how"] == "float":
                return h.float()
            if op["how"] == "f64":
                return h.to(torch.float64).to(torch.float32)
            return (h.double() * 1.5).type_as(h)
        if kind == "autofn":
            return _ScaledIdentity.apply(h, c)
        if kind == "gb":
            torch._dynamo.graph_break()
            return h
        raise ValueError(kind)


class Seq(nn.Module):
    def __init__(self, ops: list[Spec], b: int, s: int, d: int) -> None:
        super().__init__()
        self.steps = nn.ModuleList([make_op(op, b, s, d) for op in ops])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            h = step(h)
        return h


class Residual(nn.Module):
    def __init__(self, op: Spec, b: int, s: int, d: int) -> None:
        super().__init__()
        self.style = op["style"]
        self.body = Seq(op["body"], b, s, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.body(h)
        st = self.style
        if st == "none":
            return y
        if st == "add":
            return h + y
        if st == "iadd":  # in place on the branch output, as `out += residual`
            y += h
            return y
        if st == "add_":
            y.add_(h)
            return y
        if st == "alias_iadd":
            a = y
            a += h
            return y
        if st == "view_iadd":  # through a view of the branch output
            v = y.view(-1, y.shape[-1])
            v += h.reshape(-1, h.shape[-1])
            return y
        # iadd_h: in place on the stream itself (invalid when the body saved it)
        h += y
        return h


class Checkpointed(nn.Module):
    def __init__(self, op: Spec, b: int, s: int, d: int) -> None:
        super().__init__()
        self.body = Seq(op["body"], b, s, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, h, use_reentrant=False)


def make_op(op: Spec, b: int, s: int, d: int) -> nn.Module:
    kind = op["kind"]
    if kind == "lowrank":
        return LowRank(op, d, d)
    if kind == "dense":
        return nn.Linear(d, d, bias=op.get("bias", False))
    if kind == "norm":
        return Norm(op, d)
    if kind == "attn":
        return Attention(op, d, s)
    if kind == "rope":
        return Rope(op, d, s)
    if kind == "res":
        return Residual(op, b, s, d)
    if kind == "ckpt":
        return Checkpointed(op, b, s, d)
    return Op(op, b, s, d)


class Output(nn.Module):
    def __init__(self, op: Spec, d: int) -> None:
        super().__init__()
        self.how = op["how"]
        if self.how == "lowrank":
            self.proj = LowRank(op, d, op["d_out"])
        elif self.how == "dense":
            self.proj = nn.Linear(d, op["d_out"], bias=op.get("bias_up", False))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how in ("lowrank", "dense"):
            return self.proj(h)
        if self.how == "sum_last":
            return h.sum(-1)
        if self.how == "mean_seq":
            return h.mean(1)
        return h


class Program(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        b, s, d = spec["b"], spec["s"], spec["d"]
        self.body = Seq(spec["ops"], b, s, d)
        self.out = Output(spec.get("out", {"how": "h"}), d)
        # a replicated scalar parameter on the output (every program then has a gradient)
        self.gain = nn.Parameter(torch.tensor(1.25)) if spec.get("gain") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(self.body(x))
        return y * self.gain if self.gain is not None else y


def build(spec: Spec) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The spec's module (parameters from ``torch.manual_seed(spec["seed"])``) and input."""
    with torch.random.fork_rng():
        torch.manual_seed(spec["seed"])
        model = Program(spec)
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    x = torch.randn(spec["b"], spec["s"], spec["d"], generator=g)
    return model, (x,)


def loss_weights(spec: Spec, out: torch.Tensor) -> torch.Tensor:
    """Fixed random weights for ``(out * w).sum()``: not sign- or permutation-invariant."""
    g = torch.Generator().manual_seed(spec["seed"] + 2)
    return torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)


# --------------------------------------------------------------------------------------
# The hypothesis strategy
# --------------------------------------------------------------------------------------

CONSTS = [0.5, 1.5, 2.0, -0.75, 0.25]
RES_STYLES = ["add", "add", "iadd", "add_", "alias_iadd", "view_iadd"]


def fresh_after(op: Spec, before: bool, body_end: bool = True) -> bool:
    """Whether the stream after ``op`` is saved by no autograd node (so in place is legal)."""
    kind = op["kind"]
    if kind == "act":
        return op["fn"] not in ("relu", "tanh")
    if kind == "inplace":
        return op["fn"] not in ("relu_", "relu_mod")
    if kind == "gb" or (kind == "cast" and op["how"] == "float"):
        return before
    if kind == "ckpt":
        return body_end
    if kind == "res":
        return body_end if op["style"] != "add" else True
    return True


def _heads_for(d: int, even_hd: bool = False) -> list[int]:
    return [
        h
        for h in (1, 2, 3, 4, 6, 8)
        if d % h == 0 and d // h >= 2 and (not even_hd or (d // h) % 2 == 0)
    ]


def programs(max_ops: int = 5, max_depth: int = 2) -> Any:
    """Hypothesis strategy of program specs."""
    from hypothesis import strategies as st

    @st.composite
    def lowrank(draw: Any, kind: str = "lowrank") -> Spec:
        mid = draw(st.sampled_from(["silu", "gelu", "relu", "none", "mulc"]))
        op = {
            "kind": kind,
            "style": draw(st.sampled_from(["linear", "flinear", "matmul"])),
            "r": draw(st.sampled_from([2, 4, 4, 6, 8, 3])),
            "bias_down": draw(st.booleans()),
            "bias_up": draw(st.booleans()),
            "mid": mid,
        }
        if mid == "mulc":
            op["c"] = draw(st.sampled_from(CONSTS))
        return op

    @st.composite
    def norm(draw: Any, d: int, per_head: bool = True) -> Spec:
        op = {
            "kind": "norm",
            "how": draw(
                st.sampled_from(["rms_mod", "ln_mod", "f_rms", "f_ln", "written", "written_f32"])
            ),
            "affine": draw(st.booleans()),
            "heads": 0,
        }
        hs = [h for h in _heads_for(d) if h > 1]
        if per_head and hs and draw(st.integers(0, 3)) == 0:
            op["heads"] = draw(st.sampled_from(hs))
        return op

    @st.composite
    def attn(draw: Any, d: int) -> Spec | None:
        hs = _heads_for(d)
        if not hs:
            return None
        H = draw(st.sampled_from(hs))
        hd = d // H
        kvs = [k for k in range(1, H + 1) if H % k == 0]
        op = {
            "kind": "attn",
            "H": H,
            "kv": draw(st.sampled_from(kvs)),
            "proj": draw(st.sampled_from(["lowrank", "lowrank", "lowrank", "dense"])),
            "r": draw(st.sampled_from([2, 4, 6, 8])),
            "style": draw(st.sampled_from(["sdpa", "manual"])),
            "causal": draw(st.booleans()),
            "rope": hd % 2 == 0 and draw(st.booleans()),
            "qk_norm": None,
            "view": draw(st.sampled_from(["shape", "neg"])),
        }
        if draw(st.integers(0, 3)) == 0:
            op["qk_norm"] = draw(norm(hd, per_head=False))
        return op

    @st.composite
    def leaf(draw: Any, b: int, s: int, d: int, fresh: bool) -> Spec:
        """One op; in-place ops only where the stream is ``fresh`` (autograd saved it nowhere)."""
        kinds = (
            ["lowrank"] * 4
            + ["norm"] * 2
            + ["attn"] * 2
            + ["act", "slice", "reduce", "where", "cast", "autofn", "rope", "gb", "dense"]
        )
        if fresh:
            kinds += ["inplace"] * 3
        kind = draw(st.sampled_from(kinds))
        if kind == "lowrank":
            return draw(lowrank())
        if kind == "norm":
            return draw(norm(d))
        if kind == "attn":
            op = draw(attn(d))
            if op is not None:
                return op
            kind = "act"
        if kind == "rope":
            hs = _heads_for(d, even_hd=True)
            if hs:
                return {"kind": "rope", "H": draw(st.sampled_from(hs))}
            kind = "act"
        c = draw(st.sampled_from(CONSTS))
        if kind == "act":
            return {
                "kind": "act",
                "fn": draw(st.sampled_from(["silu", "gelu", "relu", "tanh", "mulc"])),
                "c": c,
            }
        if kind == "inplace":
            return {
                "kind": "inplace",
                "fn": draw(st.sampled_from(["mul_", "relu_", "silu_", "relu_mod", "add_"])),
                "c": c,
            }
        if kind == "dense":
            return {"kind": "dense", "bias": draw(st.booleans())}
        if kind == "slice":
            dim = draw(st.sampled_from([1, 2, 2]))
            n = s if dim == 1 else d
            how = draw(
                st.sampled_from(["chunk", "split", "index"] if n % 2 == 0 else ["split", "index"])
            )
            return {
                "kind": "slice", "dim": dim, "how": how, "k": draw(st.integers(1, n - 1)),
                "fn": draw(st.sampled_from(["silu", "mulc", "relu", "none"])), "c": c, "swap": draw(st.booleans()),
            }  # fmt: skip
        if kind == "reduce":
            return {
                "kind": "reduce", "op": draw(st.sampled_from(["sum", "mean"])),
                "dim": draw(st.sampled_from([0, 1, 2, -1])), "keepdim": draw(st.booleans()),
                "c": draw(st.sampled_from([0.5, 0.25, -0.5])),
            }  # fmt: skip
        if kind == "where":
            hows = ["where", "masked_fill"] + (["masked_fill_"] if fresh else [])
            return {
                "kind": "where", "how": draw(st.sampled_from(hows)),
                "mask": draw(st.sampled_from(["buf_sd", "buf_d", "buf_bsd", "arange_d"])),
                "mask_seed": draw(st.integers(0, 100)), "c": c,
            }  # fmt: skip
        if kind == "cast":
            return {"kind": "cast", "how": draw(st.sampled_from(["float", "f64", "type_as"]))}
        if kind == "autofn":
            return {"kind": "autofn", "c": c}
        return {"kind": "gb"}

    def ops(b: int, s: int, d: int, depth: int, n: int, fresh: bool, first: bool = False) -> Any:
        """A list of ops and whether its result is fresh."""

        @st.composite
        def seq(draw: Any) -> tuple[list[Spec], bool]:
            out: list[Spec] = []
            state = fresh
            for i in range(draw(st.integers(1, n))):
                if depth < max_depth and draw(st.integers(0, 2)) == 0:
                    ckpt = draw(st.integers(0, 4)) == 0
                    # checkpoint saves its input: nothing in its body may mutate that
                    body, end = draw(ops(b, s, d, depth + 1, 3, state and not ckpt))
                    if ckpt:
                        op: Spec = {"kind": "ckpt", "body": body}
                    else:
                        # in place on the body's output needs it fresh; on the stream
                        # (iadd_h) only where the stream is the program's input
                        styles = ["add", "add", "none"] + (RES_STYLES if end else [])
                        styles += ["iadd_h"] if first and i == 0 else []
                        op = {"kind": "res", "style": draw(st.sampled_from(styles)), "body": body}
                else:
                    op, end = draw(leaf(b, s, d, state)), True
                out.append(op)
                state = fresh_after(op, state, end)
            return out, state

        return seq()

    @st.composite
    def block(draw: Any, d: int) -> Spec:
        """The common shape: residual around (norm, bottleneck or attention)."""
        inner = draw(attn(d)) if draw(st.booleans()) else None
        inner = inner or draw(lowrank())
        style = draw(st.sampled_from(RES_STYLES))
        return {"kind": "res", "style": style, "body": [draw(norm(d)), inner]}

    @st.composite
    def program(draw: Any) -> Spec:
        d = draw(st.sampled_from([8, 12, 16, 16, 24, 32] * 4 + [9, 15, 12, 6]))
        b = draw(st.sampled_from([1, 2]))
        s = draw(st.sampled_from([4, 6, 8]))
        body: list[Spec] = []
        for _ in range(draw(st.integers(0, 2))):
            body.append(draw(block(d)))
        more, _ = draw(ops(b, s, d, 0, max_ops, fresh=True, first=not body))
        body += more
        how = draw(st.sampled_from(["h", "h", "lowrank", "dense", "sum_last", "mean_seq"]))
        out: Spec = {"how": how}
        if how == "lowrank":
            out.update(draw(lowrank("out")))
        if how in ("lowrank", "dense"):
            out["d_out"] = draw(st.sampled_from([d, 2 * d, 10, 7]))
            out.setdefault("bias_up", draw(st.booleans()))
        return {
            "seed": draw(st.integers(0, 2**16)), "b": b, "s": s, "d": d, "ops": body, "out": out,
            "gain": draw(st.booleans()),
        }  # fmt: skip

    return program()
