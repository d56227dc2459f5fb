"""The zoo: causal-LM families of ``transformers`` at tp=2 against one device (issue 16, part 4).

Every family from a tiny config (hidden 64, 2 layers, 4 query / 2 key-value heads
of 16, vocab 96, dropout off), converted by ``to_low_rank(method="cola",
multiple_of=8)``, parallelized at tp=2 and trained eagerly for 3 SGD steps through
HF's own loss, against an untouched single-device copy: logits, loss, every
gathered gradient each step, every gathered parameter after the last
(:func:`tests.region_checks._compare`). Reported per family: the bottlenecks the
plan found, the fallbacks (``model.boost_plan.fallbacks``) and the forward
collectives that ran (profiler ``gloo:*`` events of one forward), also per layer.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch

from tests.mutation_checks import _gather, _rel
from tests.tp_harness import wire

LAYERS, VOCAB = 2, 96
_DIMS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=172, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
)  # fmt: skip
_HEAD = dict(head_dim=16)
_NO_DROP = dict(attention_dropout=0.0)
# Token ids in range for every family (pad/bos/eos inside the vocabulary).
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (config class, model class, config kwargs). MoE families are listed in MOE.
# fmt: off
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_DIMS, **_HEAD, **_NO_DROP}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_DIMS, **_NO_DROP}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DIMS, **_HEAD, **_NO_DROP}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_DIMS, **_HEAD, **_NO_DROP}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DIMS, **_HEAD, **_NO_DROP, **_IDS}),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        {**_DIMS, **_HEAD, **_NO_DROP, **_IDS, "query_pre_attn_scalar": 16, "sliding_window": 8},
    ),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        {**_DIMS, **_HEAD, **_NO_DROP, **_IDS, "query_pre_attn_scalar": 16, "sliding_window": 8},
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_DIMS, **_NO_DROP, **_IDS}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**_DIMS, **_NO_DROP, **_IDS}),
    "gpt_neox": (
        "GPTNeoXConfig", "GPTNeoXForCausalLM",
        {**{k: v for k, v in _DIMS.items() if k != "num_key_value_heads"}, **_IDS,
         "attention_dropout": 0.0, "hidden_dropout": 0.0, "rotary_pct": 0.5},
    ),
    "granite": (
        "GraniteConfig", "GraniteForCausalLM",
        {**_DIMS, **_NO_DROP, **_IDS, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
         "attention_multiplier": 0.25, "logits_scaling": 4.0},
    ),
    "cohere": (
        "CohereConfig", "CohereForCausalLM",
        {**_DIMS, **_NO_DROP, **_IDS, "use_qk_norm": True, "logit_scale": 0.5},
    ),
    "stablelm": (
        "StableLmConfig", "StableLmForCausalLM",
        {**_DIMS, **_IDS, "attention_dropout": 0.0, "hidden_dropout": 0.0,
         "partial_rotary_factor": 0.5, "use_qkv_bias": True},
    ),
    "starcoder2": (
        "Starcoder2Config", "Starcoder2ForCausalLM",
        {**_DIMS, **_IDS, "attention_dropout": 0.0, "residual_dropout": 0.0,
         "embedding_dropout": 0.0, "sliding_window": 8},
    ),
    "gpt2": (
        "GPT2Config", "GPT2LMHeadModel",
        dict(n_embd=64, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=32,
             bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        {**_DIMS, **_HEAD, **_NO_DROP, **_IDS, "num_local_experts": 4, "num_experts_per_tok": 2,
         "router_jitter_noise": 0.0},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {**_DIMS, **_HEAD, **_NO_DROP, **_IDS, **_MOE, "num_experts": 4},
    ),
    "deepseek_v3": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        {**_DIMS, **_NO_DROP, **_IDS, **_MOE, "num_key_value_heads": 4, "q_lora_rank": 32,
         "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
         "first_k_dense_replace": 1},
    ),
}
# fmt: on
MOE = ("mixtral", "qwen3_moe", "deepseek_v3")

# DeepSeek-V3 variants for tests/test_mla.py: key -> (family, config overrides, to_low_rank
# keyword arguments). In the zoo's own conversion the q a/b projections become CoLA pairs
# and the kv ones stay dense (their ranks round to 0); "dense-mla" keeps every MLA
# projection dense (the latent chains as DeepSeek ships them), "no-q-lora" has a plain
# q_proj (q_lora_rank=None), "dense-mlp" no MoE layer (every forward collective known),
# "factored" every MLA projection a CoLA pair.
_MLA = ["*.q_a_proj", "*.q_b_proj", "*.kv_a_proj_with_mqa", "*.kv_b_proj"]
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "deepseek_v3/dense-mla": ("deepseek_v3", {}, {"exclude": _MLA}),
    "deepseek_v3/no-q-lora": ("deepseek_v3", {"q_lora_rank": None}, {}),
    "deepseek_v3/dense-mlp": ("deepseek_v3", {"first_k_dense_replace": LAYERS}, {}),
    # rank_ratio 1/2: kv_a (64 -> 8 -> 24) and kv_b (16 -> 8 -> 96) are CoLA pairs too
    "deepseek_v3/factored": ("deepseek_v3", {}, {"rank_ratio": 0.5}),
}


def build(family: str, **overrides: Any) -> torch.nn.Module:
    """The family's ``*ForCausalLM`` from its tiny config, CoLA-converted, in training mode.

    ``family`` may be a key of :data:`VARIANTS`; ``overrides`` change the config further.
    """
    import transformers as tf

    import boost_compiler

    base, changes, lowrank = VARIANTS.get(family, (family, {}, {}))
    cfg_name, model_name, kwargs = FAMILIES[base]
    torch.manual_seed(0)
    cfg = getattr(tf, cfg_name)(**{**kwargs, **changes, **overrides})
    model = getattr(tf, model_name)(cfg)
    boost_compiler.to_low_rank(model, method="cola", multiple_of=8, **lowrank)
    return model.train()


def zoo_family(
    family: str,
    *,
    world: int,
    mesh: Any,
    steps: int = 3,
    lr: float = 1e-3,
    noise: bool = False,
    compiled: bool = False,
) -> dict[str, Any]:
    """One family at tp=``world``: SGD steps against one device, and what the plan did.

    ``lr=1e-3``: HF's initialisation makes these tiny models chaotic under large
    steps (see ``tests.tp_harness.compare_training_hf``); measured with a twin
    perturbed by 1e-7 (``noise=True``), fp32 reordering alone reaches 1.2e-5 by
    the third step at lr=0.01 (Gemma 3) and 4.9e-5 at 0.1 (Qwen2); at 1e-3 it
    stays under 4e-6 in every family. A model that ``parallelize`` refuses is
    reported as ``refused`` (every rank refuses alike, before any collective).
    ``compiled``: through ``torch.compile(model, backend="boost")`` (Inductor).
    """
    import time

    import boost_compiler

    wall, cpu = time.perf_counter(), time.process_time()
    model = build(family)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids, "use_cache": False}
    try:
        boost_compiler.parallelize(model, mesh, (ids,), kwargs)
    except Exception as exc:  # noqa: BLE001 (reported, the test decides)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    plan = model.boost_plan
    run = torch.compile(model, backend="boost") if compiled else model
    run(ids, **kwargs)  # the first call also compares the ranks' shapes (parallel/agreement.py)
    wire = _wire(lambda: run(ids, **kwargs))  # the collectives of one forward, as they ran
    errs = _train(model, ref, ids, world, steps=steps, lr=lr, run=run)
    if noise:  # what fp32 rounding alone does: a perturbed single-device twin
        twin, ref2 = build(family), build(family)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for prm in twin.parameters():
                prm.mul_(1 + 1e-7 * torch.randn(prm.shape, generator=g))
        errs["noise"] = _train(twin, ref2, ids, 1, steps=steps, lr=lr, plain=True)["grad"]
    return {
        **errs,
        "bottlenecks": len(plan.bottlenecks),
        "fallbacks": list(plan.fallbacks),
        "forward_collectives": len(wire),
        "forward_wire": wire,
        "per_layer": len(wire) / LAYERS,
        "planned_forward": dict(Counter(c.kind for c in plan.collectives if c.forward)),
        "seconds": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
    }


def _wire(fn: Any) -> list[tuple[str, list[int]]]:
    """The gloo collectives ``fn`` ran, in order: (event name, shape of its tensor)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [
        (e.name, list(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else [])
        for e in prof.events()
        if e.name.startswith("gloo:")
    ]


def _train(model, ref, ids, world, *, steps, lr, plain=False, run=None) -> dict[str, Any]:
    """:func:`tests.region_checks._compare` with the learning rate and per-step errors."""
    params = None if plain else model.boost_plan.params
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    errs: dict[str, Any] = {"logits": [], "loss": [], "grad": []}
    for step in range(steps):
        labels = ids.roll(step + 1, dims=1)  # cross-entropy against fixed targets
        out = (model if run is None else run)(ids, labels=labels, use_cache=False)
        out_ref = ref(ids, labels=labels, use_cache=False)
        errs["logits"].append(_rel(out.logits.detach(), out_ref.logits.detach()))
        errs["loss"].append(_rel(out.loss.detach(), out_ref.loss.detach()))
        opt.zero_grad()
        opt_ref.zero_grad()
        out.loss.backward()
        out_ref.loss.backward()
        grad = 0.0
        for (name, prm), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = prm.grad if plain else _gather(prm.grad, params[name], world)
            grad = max(grad, _rel(g, q.grad))
        errs["grad"].append(grad)
        opt.step()
        opt_ref.step()
    errs["param"] = max(
        _rel(p.detach() if plain else _gather(p.detach(), params[n], world), q.detach())
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    return errs


class RuleProbe(torch.nn.Module):
    """The ops the zoo's rule fixes cover, in one CoLA block (regression of issue 16, part 4).

    Cohere's interleaved rotary (``torch.stack([-x2, x1], -1).flatten(-2)``) and a
    stack before the shard dim read back with ``torch.flatten``, on head-sharded
    values; a MoE block's token gather ``hidden[order]`` on a hidden shard, once
    with no gathered copy (stays sharded) and once after a dense router read the
    full hidden (indexes that copy); an index that differs per rank
    (``scale[(q > 0).long()]``), which must gather.
    """

    D, R, HEADS = 16, 8, 4

    def __init__(self) -> None:
        super().__init__()
        d, r = self.D, self.R
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.down = torch.nn.Linear(d, r, bias=False)
        self.up = torch.nn.Linear(r, d, bias=False)
        self.router = torch.nn.Linear(d, 4, bias=False)
        self.scale = torch.nn.Parameter(torch.tensor([0.5, 2.0]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        h = self.emb(ids)
        q = self.up(torch.nn.functional.silu(self.down(h)))  # hidden-sharded
        q4 = q.view(b, s, self.HEADS, self.D // self.HEADS)  # head-sharded
        x1, x2 = q4[..., ::2], q4[..., 1::2]
        rot = torch.stack([-x2, x1], dim=-1).flatten(-2)  # Cohere's rotate_half
        both = torch.flatten(torch.stack([x1, x2], dim=1), 1, 2)  # [b, 2s, heads, hd/2]
        extra = both[:, :s] * x1
        mixed = (rot * q4 + torch.cat([extra, extra], dim=-1)).reshape(b, s, self.D)
        flat = mixed.reshape(b * s, self.D)
        order = torch.argsort(ids.reshape(-1))  # replicated integer index
        picked = flat[order]  # no gathered copy: sharded rows
        weights = self.router(h.reshape(b * s, self.D)).softmax(-1)  # gathers the hidden
        again = h.reshape(b * s, self.D)[order]  # reads the router's copy
        out = picked + again * weights[:, :1]
        gate = self.scale[(q > 0).long()]  # an index that differs per rank: gathers
        return out.reshape(b, s, self.D) * gate


def rule_probe(*, world: int, mesh: Any) -> dict[str, Any]:
    """:class:`RuleProbe` at tp=``world`` against one device: output, every gradient."""
    import boost_compiler

    torch.manual_seed(0)
    model = RuleProbe()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    boost_compiler.parallelize(model, mesh, (ids,))
    plan = model.boost_plan
    fixed = torch.randn(2, 8, RuleProbe.D, generator=torch.Generator().manual_seed(3))
    model(ids)  # compiled first, so the profiled call below holds only what a step runs
    out, ran = wire(lambda: model(ids))
    out_ref = ref(ids)
    (out * fixed).sum().backward()
    (out_ref * fixed).sum().backward()
    grad = max(
        _rel(_gather(p.grad, plan.params[n], world), q.grad)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)
    )
    return {
        "out": _rel(out.detach(), out_ref.detach()),
        "grad": grad,
        "fallbacks": list(plan.fallbacks),
        "params": {n: str(pl) for n, pl in plan.params.items()},
        "planned_forward": [(c.kind, list(c.global_shape)) for c in plan.collectives if c.forward],
        "ran_forward": [(name, shape) for name, shape, _ in ran],
    }
