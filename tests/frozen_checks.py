"""Checks of tests/test_frozen_lora.py: a LoRA-on-frozen-Llama at tp=2 (issue 44, item 8).

The model is written as loralib writes LoRA: every q/k/v/o and MLP projection keeps its
pretrained ``weight`` frozen (``requires_grad=False``) beside trainable ``lora_A [r, in]``
and ``lora_B [out, r]``, ``y = x @ W.T + scale * (x @ A.T) @ B.T``; the embedding, the
norms and the head are frozen too, as PEFT leaves them. Each rank trains it for a few SGD
steps against one device (eager, or compiled with the ``"eager"`` lowering) and reports
the errors, its parameter bytes against one device's, and the bytes gloo sent.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests import tp_harness as H
from tests.gather_checks import rotate_halves

D, HEADS, FF, RANK, V, LAYERS = 256, 4, 512, 8, 256, 2
HD = D // HEADS
_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4}


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class LoRALinear(nn.Module):
    """loralib's ``Linear``: a frozen ``weight`` and a trainable rank-``RANK`` update.

    ``lora_B`` is drawn, not zeroed as loralib starts it, so ``lora_A``'s gradient is
    not zero and its comparison with one device means something.
    """

    base = "weight"  # the frozen weight's name in this module

    def __init__(self, d_in: int, d_out: int, bias: bool = False, alpha: float = 16.0) -> None:
        super().__init__()
        self.weight = _frozen(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = _frozen(0.1 * torch.randn(d_out)) if bias else None
        self.lora_A = nn.Parameter(torch.randn(RANK, d_in) / math.sqrt(d_in))
        self.lora_B = nn.Parameter(0.02 * torch.randn(d_out, RANK))
        self.scaling = alpha / RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = x @ self.lora_A.transpose(0, 1) @ self.lora_B.transpose(0, 1)
        return F.linear(x, self.weight, self.bias) + lora * self.scaling


class RMSNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = _frozen(1.0 + 0.1 * torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.to(torch.float32)  # as HF's LlamaRMSNorm
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
        # Frozen biases where Qwen2 has them (q/k/v), and on the row-parallel down projection.
        self.q, self.k, self.v = (LoRALinear(D, D, bias=True) for _ in range(3))
        self.o = LoRALinear(D, D)
        self.gate, self.up = LoRALinear(D, FF), LoRALinear(D, FF)
        self.down = LoRALinear(FF, D, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, s, HEADS, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(rotate_halves(q), rotate_halves(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FusedBlock(Block):
    """:class:`Block` with q, k and v as one frozen fused projection (GPT-2's ``c_attn``,
    Phi-3's ``qkv_proj``) and its LoRA update, split into the three after the sum."""

    def __init__(self) -> None:
        super().__init__()
        del self.q, self.k, self.v
        self.qkv = LoRALinear(D, 3 * D, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HD).transpose(1, 2)
                   for t in self.qkv(self.attn_norm(x)).split(D, dim=-1))  # fmt: skip
        y = F.scaled_dot_product_attention(rotate_halves(q), rotate_halves(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LoRALlama(nn.Module):
    """A small Llama whose pretrained weights are all frozen; only the LoRA factors train."""

    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = RMSNorm()
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


class PeftLinear(nn.Module):
    """PEFT's LoRA ``Linear``: the model's own ``nn.Linear`` as a frozen ``base_layer`` and
    ``lora_B(lora_A(x))`` two ``nn.Linear`` (``lora_B`` drawn, not zeroed, as above)."""

    base = "base_layer.weight"

    def __init__(self, base_layer: nn.Linear, alpha: float = 16.0) -> None:
        super().__init__()
        self.base_layer = base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(base_layer.in_features, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, base_layer.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scaling = alpha / RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _hf_llama() -> nn.Module:
    """A tiny HF ``LlamaForCausalLM`` (grouped kv heads) with PEFT's LoRA on every projection."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, attention_dropout=0.0,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(cfg).requires_grad_(False)
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, "q k v o"), (layer.mlp, "gate up down")):
            for name in names.split():
                setattr(owner, f"{name}_proj", PeftLinear(getattr(owner, f"{name}_proj")))
    return model.train()


MAKERS = {"loralib": LoRALlama, "peft_hf": _hf_llama, "fused_qkv": lambda: LoRALlama(FusedBlock)}


def build(maker: str = "loralib", seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
    return MAKERS[maker](), ids


def frozen_whole(model: nn.Module, plan: Any) -> Any:
    """``plan`` with every frozen LoRA base weight replicated: what the planner chose before
    frozen weights were split (their inputs gathered), as a plan to force."""
    from boost_compiler import TPPlan
    from boost_compiler.tp.placement import R

    lora = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A")]
    bases = {f"{n}.{m.base}" for n, m in lora} | {f"{n}.{m.base[:-6]}bias" for n, m in lora}
    params = {n: R if n in bases else pl for n, pl in plan.params.items()}
    return TPPlan(p=plan.p, group=plan.group, params=params)


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def sent_bytes(events: list, p: int) -> float:
    """Bytes this rank sent for gloo's events (ring algorithms, as ``tp/plan_cost.py`` counts):
    an all-reduce ``2(p-1)/p`` of its input, an all-gather ``p-1`` shard inputs, a
    reduce-scatter ``(p-1)/p`` of its input. Counting inputs alone would weigh a
    reduce-scatter ``p`` times an all-gather that sends as much."""
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": p - 1, "reduce_scatter": (p - 1) / p}
    total = 0.0
    for name, shape, dtype in events:
        kind = next((k for k in factor if k in name), None)
        total += math.prod(shape) * _BYTES.get(dtype, 4) * (factor[kind] if kind else 1)
    return total


def ring_bytes(plan: Any) -> dict[str, float]:
    """Forward and backward bytes a rank sends for the plan's collectives with ring
    algorithms (NCCL's; gloo runs a reduce-scatter as an all-reduce of its whole input)."""
    from boost_compiler.tp.plan_cost import all_reduce, gather

    out = {"forward": 0.0, "backward": 0.0}
    for c in plan.collectives:
        n = math.prod(c.global_shape) * c.dtype.itemsize
        sent = all_reduce(n, plan.p) if c.kind == "all_reduce" else gather(n, plan.p)
        out["forward"] += sent * c.forward
        out["backward"] += sent * c.backward
    return out


def lora_training(
    lowering: str | None, whole: bool = False, maker: str = "loralib", lr: float = 0.1, *,
    world: int, mesh: Any, steps: int = 3,
) -> dict[str, Any]:  # fmt: skip
    """``steps`` SGD steps at tp=``world`` against one device; ``lowering``: compiled so,
    None: eager. ``whole``: the frozen base weights forced replicated (the old plan)."""
    import boost_compiler

    model, ids = build(maker)
    ref = copy.deepcopy(model)
    frozen0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    forced = None
    if whole:
        probe = copy.deepcopy(model)
        boost_compiler.parallelize(probe, mesh, (ids,), {"labels": ids})
        forced = frozen_whole(model, probe.boost_plan)
    boost_compiler.parallelize(model, mesh, (ids,), {"labels": ids}, plan=forced)
    plan = model.boost_plan
    run = model if lowering is None else H._compiled(model, lowering)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr)
            for m in (model, ref)]  # fmt: skip
    res: dict[str, Any] = {"loss_err": 0.0, "grad_err": 0.0, "step_err": [0.0] * steps}
    res["frozen_grads"] = []
    for i in range(steps):
        for opt in opts:
            opt.zero_grad()
        if i == 1:  # past any compile: what one step sends
            loss, fwd = H.wire(lambda: _loss(run(ids, labels=ids)))
            bwd = H.wire(loss.backward)[1]
            res["wire_fwd"], res["wire_bwd"] = sent_bytes(fwd, world), sent_bytes(bwd, world)
            res["events"] = sorted({name for name, _, _ in fwd + bwd})
        else:
            loss = _loss(run(ids, labels=ids))
            loss.backward()
        loss_ref = _loss(ref(ids, labels=ids))
        loss_ref.backward()
        res["loss_err"] = max(res["loss_err"], abs(loss.item() - loss_ref.item()) / loss_ref.item())
        for (name, prm), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            if not prm.requires_grad:
                if prm.grad is not None or q.grad is not None:
                    res["frozen_grads"].append(name)
                continue
            g = H._gathered_grad(prm, plan.params[name], world)
            err = max(H._norm_rel(g, q.grad), H._rel(g, q.grad))
            res["step_err"][i] = max(res["step_err"][i], err)
            if err > res["grad_err"]:
                res["grad_err"], res["grad_worst"] = err, f"{name} (step {i})"
        for opt in opts:
            opt.step()
    # What a single-device model loads: every frozen weight gathered whole, unchanged.
    saved = boost_compiler.gather_state_dict(model)
    res["state_dict_changed"] = [n for n, t in frozen0.items() if not torch.equal(saved[n], t)]
    params = dict(model.named_parameters())
    res["frozen_changed"] = [
        n for n, t in frozen0.items()
        if not torch.equal(H._gathered(params[n].detach(), plan.params[n], world), t)
    ]  # fmt: skip
    res["param_err"] = max(
        H._rel(H._gathered(prm.detach(), plan.params[n], world), q.detach())
        for (n, prm), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    return {**res, "bytes_ratio": local / total, "local_bytes": local, "total_bytes": total,
            "fallbacks": list(plan.fallbacks), "route": plan.route, "ring": ring_bytes(plan),
            "replicated": sorted(n for n, pl in plan.params.items() if not pl.is_shard),
            "lora_trainable": sorted(plan.trainable)}  # fmt: skip
