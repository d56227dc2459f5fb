"""Other projects' low-rank checkpoints as their own code lays them out, and their forwards.

For each layout: a writer of a tiny folder in the layout's own key names, shapes and
files (random weights), a reader of such a folder, and the model's forward written from
the layout's published math (``y = act(x A) B`` for CoLA, ``x W_in W_out^T`` for LORO,
``x (B A alpha / r + S)^T`` for SLTrain, ...). Nothing here calls
``boost_compiler.layouts``: the references are independent of the importers they check.
Sources: alvin-zyl/CoLA (cola/cola_layer.py, modeling_cola.py, modeling_colam.py),
mzf666/LORO-main (loro_torch/lowrank_module.py), andyjm3/SLTrain (splora/splora_linear.py,
sparse-lora/sparse_linear.cpp), huggingface/nanotron (serialize/weights.py) and the issue
text for the BOOST fork's names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

D, FF, LAYERS, HEADS, VOCAB, RANK = 64, 128, 2, 4, 256, 16
HD = D // HEADS
KV_HEADS = {"cola": 4, "cola-m": 4, "loro": 2, "sltrain": 2, "boost-nanotron": 2}
LAYOUTS = tuple(KV_HEADS)
EPS = 1e-6
SLTRAIN_ALPHA = 24.0  # scale 1.5: not a power of two, so folding it rounds
SP_RATIO = 0.03
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
        "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
        "down": "mlp.down_proj"}  # fmt: skip


def _dims(kv: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    return {"q": (D, HEADS * HD), "k": (D, kv * HD), "v": (D, kv * HD), "o": (HEADS * HD, D),
            "gate": (D, FF), "up": (D, FF), "down": (FF, D)}  # fmt: skip


def _llama_config(kv: int, **extra: Any) -> dict[str, Any]:
    return {"hidden_act": "silu", "hidden_size": D, "intermediate_size": FF,
            "num_attention_heads": HEADS, "num_key_value_heads": kv, "num_hidden_layers": LAYERS,
            "vocab_size": VOCAB, "rms_norm_eps": EPS, "bos_token_id": 0, "eos_token_id": 1,
            "initializer_range": 0.02, "max_sequence_length": 1024, "use_cache": True,
            **extra}  # fmt: skip


class Gen:
    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std


def _outside(g: Gen) -> dict[str, torch.Tensor]:
    """Embeddings, norms and head under transformers' Llama names (CoLA, LORO, SLTrain)."""
    t = {"model.embed_tokens.weight": g(VOCAB, D, std=1.0),
         "model.norm.weight": 1 + g(D, std=0.1), "lm_head.weight": g(VOCAB, D, std=D**-0.5)}  # fmt: skip
    for i in range(LAYERS):
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{n}.weight"] = 1 + g(D, std=0.1)
    return t


def _inv_freq(theta: float = 10000.0, head_dim: int = HD) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


# ---- the folders, in each project's own names ---------------------------------------------


def _cola_tensors(g: Gen, bias: bool = False) -> dict[str, torch.Tensor]:
    t = _outside(g)
    for i in range(LAYERS):
        for p, (d_in, d_out) in _dims(HEADS).items():
            t[f"model.layers.{i}.{PROJ[p]}.cola_a"] = g(d_in, RANK, std=d_in**-0.5)
            t[f"model.layers.{i}.{PROJ[p]}.cola_b"] = g(RANK, d_out, std=RANK**-0.5)
            if bias:  # ColaLayer(bias=config.attention_bias / mlp_bias): every projection
                t[f"model.layers.{i}.{PROJ[p]}.bias"] = g(d_out, std=0.1)
    return t


def _colam_name(key: str) -> str:
    """CoLA's key in CoLA-M's modules (cola/modeling_colam.py): q/k/v/gate/up/o/down split
    into pre_* (cola_a) and post_* (cola_b and bias: ColaMUpProjLayer), down's one layer
    later."""
    m = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(cola_a|cola_b|bias)$", key)
    if m is None:
        return key
    i, p, leaf = int(m[1]), m[3], m[4]
    if leaf == "cola_a":
        owner = {"q": "pre_attn", "k": "pre_attn", "v": "pre_attn", "o": "self_attn",
                 "gate": "pre_mlp", "up": "pre_mlp", "down": "self_mlp"}[p]  # fmt: skip
        return f"model.layers.{i}.{owner}.pre_{p}_proj.cola_a"
    if p == "down":
        if i == LAYERS - 1:
            return f"model.layers.{i}.post_mlp.post_down_proj.{leaf}"
        return f"model.layers.{i + 1}.last_layer_post_mlp.post_down_proj.{leaf}"
    owner = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "post_attn",
             "gate": "self_mlp", "up": "self_mlp"}[p]  # fmt: skip
    return f"model.layers.{i}.{owner}.post_{p}_proj.{leaf}"


def _loro_tensors(g: Gen, scope: str, attn_rank: int, mlp_rank: int) -> dict[str, torch.Tensor]:
    """apply_lowrank_param's --loro_scope all / attn / mlp: the other half keeps its dense
    nn.Linear ``weight``; --loro_attn_rank / --loro_mlp_rank per half."""
    t = _outside(g)
    for i in range(LAYERS):
        t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = _inv_freq()
        for p, (d_in, d_out) in _dims(KV_HEADS["loro"]).items():
            key, half = f"model.layers.{i}.{PROJ[p]}", PROJ[p].split(".")[0]
            if scope not in ("all", {"self_attn": "attn", "mlp": "mlp"}[half]):
                t[f"{key}.weight"] = g(d_out, d_in, std=d_in**-0.5)
                continue
            r = attn_rank if half == "self_attn" else mlp_rank
            t[f"{key}.weight_in"] = g(d_in, r, std=d_in**-0.5)
            t[f"{key}.weight_out"] = g(d_out, r, std=r**-0.5)
    return t


def _sltrain_tensors(g: Gen, trainable_scaling: bool = False) -> dict[str, torch.Tensor]:
    t = _outside(g)
    for i in range(LAYERS):
        t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = _inv_freq()
        for p, (d_in, d_out) in _dims(KV_HEADS["sltrain"]).items():
            key = f"model.layers.{i}.{PROJ[p]}"
            nnz = int(SP_RATIO * d_in * d_out)
            t[f"{key}.lora_A"] = g(RANK, d_in, std=d_in**-0.5)
            t[f"{key}.lora_B"] = g(d_out, RANK, std=RANK**-0.5)
            perm = torch.randperm(d_in * d_out, generator=g.g)[:nnz]
            t[f"{key}.sparse_index"] = torch.sort(perm).values  # as SpLoRaLinear draws it
            t[f"{key}.sparse_value"] = g(nnz, std=d_in**-0.5)
            if trainable_scaling:  # SpLoRaLinear's scaling [1] (init 1.0, then trained)
                t[f"{key}.scaling"] = 1.0 + g(1, std=0.3)
    return t


def _nanotron_tensors(
    g: Gen, qkv_up: bool = False, attn_rank: int = RANK, mlp_rank: int = RANK
) -> dict[str, torch.Tensor]:
    """``qkv_up``: the parity scripts' ``qkv_proj1 [3, out, r]`` (multi-head attention)
    instead of ``q_proj1`` and ``kv_proj1``."""
    kv = (HEADS if qkv_up else KV_HEADS["boost-nanotron"]) * HD
    ra, rm = attn_rank, mlp_rank
    t = {"model.token_position_embeddings.pp_block.token_embedding.weight": g(VOCAB, D, std=1.0),
         "model.final_layer_norm.pp_block.weight": 1 + g(D, std=0.1),
         "model.lm_head.pp_block.weight": g(VOCAB, D, std=D**-0.5)}  # fmt: skip
    for i in range(LAYERS):
        p = f"model.decoder.{i}.pp_block"
        t[f"{p}.input_layernorm.weight"] = 1 + g(D, std=0.1)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + g(D, std=0.1)
        t[f"{p}.attn.qkv_proj0.weight"] = g(3 * ra, D, std=D**-0.5)
        if qkv_up:
            t[f"{p}.attn.qkv_proj1.weight"] = g(3, HEADS * HD, ra, std=ra**-0.5)
        else:
            t[f"{p}.attn.q_proj1.weight"] = g(HEADS * HD, ra, std=ra**-0.5)
            t[f"{p}.attn.kv_proj1.weight"] = g(2, kv, ra, std=ra**-0.5)
        t[f"{p}.attn.o_proj0.weight"] = g(ra, HEADS * HD, std=D**-0.5)
        t[f"{p}.attn.o_proj1.weight"] = g(D, ra, std=ra**-0.5)
        t[f"{p}.mlp.gate_up_proj0.weight"] = g(2 * rm, D, std=D**-0.5)
        t[f"{p}.mlp.gate_up_proj1.weight"] = g(2, FF, rm, std=rm**-0.5)
        t[f"{p}.mlp.down_proj0.weight"] = g(rm, FF, std=FF**-0.5)
        t[f"{p}.mlp.down_proj1.weight"] = g(D, rm, std=rm**-0.5)
    return t


def _write_flat(folder: Path, configs: dict[str, dict], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name, cfg in configs.items():
        (folder / name).write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _write_nanotron(
    folder: Path, config: dict, tensors: dict[str, torch.Tensor], rows: frozenset[str] = frozenset()
) -> None:
    """Nanotron's tree as a tp=2 run saves it (serialize/weights.py): norms replicated, every
    other tensor in two shards with the slices it holds: along its output dimension (a
    column-parallel weight; ``[n, out, r]`` for a batched one), or along its input
    dimension for the keys in ``rows`` (row-parallel: each rank holds the columns of its
    input shard)."""
    from safetensors.torch import save_file

    (folder / "model").mkdir(parents=True, exist_ok=True)
    (folder / "model_config.json").write_text(json.dumps(config))
    for key, t in tensors.items():
        *parts, leaf = key.split(".")
        where = folder.joinpath("model", *parts)
        where.mkdir(parents=True, exist_ok=True)
        if t.dim() == 1:
            save_file({"data": t}, str(where / f"model_{leaf}.safetensors"))
            continue
        dim = 1 if key in rows or t.dim() == 3 else 0
        half = t.shape[dim] // 2
        for rank in range(2):
            local = ["None,None,None"] * t.dim()
            glob = list(local)
            local[dim], glob[dim] = f"0,{half},None", f"{rank * half},{(rank + 1) * half},None"
            meta = {"version": "1.4", "unsharded_shape": str(tuple(t.shape)),
                    "local_global_slices_pairs": f"{'|'.join(local)}#{'|'.join(glob)}"}  # fmt: skip
            shard = t.narrow(dim, rank * half, half).contiguous()
            name = f"model_{leaf}_pp-rank-0-of-1_tp-rank-{rank}-of-2.safetensors"
            save_file({"data": shard}, str(where / name), metadata=meta)


def write_folder(layout: str, folder: Path, seed: int = 0, **options: Any) -> None:
    """A tiny ``layout`` folder of random weights, as that project's own code saves it.

    ``options``, what real folders hold beyond the defaults: CoLA / CoLA-M ``only_lr_act``
    (True, False, or None: the field absent, ColaConfig's default True) and ``bias``
    (``attention_bias`` and ``mlp_bias``); LORO ``scope`` (all / attn / mlp),
    ``attn_rank``, ``mlp_rank``; SLTrain ``trainable_scaling``; Nanotron
    ``rope_interleaved``, ``qkv_up`` (``qkv_proj1``), ``attn_rank``, ``mlp_rank`` and
    ``row_parallel_qkv0`` (``qkv_proj0`` sharded along its input dimension)."""
    g = Gen(seed)
    if layout in ("cola", "cola-m"):
        model_type = {"cola": "cola", "cola-m": "cola_m"}[layout]
        arch = {"cola": "ColaForCausalLM", "cola-m": "ColaMForCausalLM"}[layout]
        bias = bool(options.get("bias", False))
        only = options.get("only_lr_act", False)
        extra = {} if only is None else {"only_lr_act": only}
        flags = {"attention_bias": True, "mlp_bias": True} if bias else {}
        cfg = _llama_config(HEADS, model_type=model_type, architectures=[arch], rank=RANK,
                            pad_token_id=0, **extra, **flags)  # fmt: skip
        t = _cola_tensors(g, bias)
        if layout == "cola-m":
            t = {_colam_name(k): v for k, v in t.items()}
        _write_flat(folder, {"config.json": cfg}, t)
    elif layout == "loro":
        cfg = _llama_config(2, model_type="llama", architectures=["LLaMAForCausalLM"],
                            pad_token_id=-1)  # configs/llama_60m.json's  # fmt: skip
        t = _loro_tensors(g, options.get("scope", "all"), options.get("attn_rank", RANK),
                          options.get("mlp_rank", RANK))  # fmt: skip
        _write_flat(folder, {"config.json": cfg}, t)
    elif layout == "sltrain":
        cfg = _llama_config(2, model_type="llama", architectures=["LLaMAForCausalLM"],
                            pad_token_id=-1)  # fmt: skip
        # SpLoRaModel.save_pretrained dumps SpLoRaConfig, built without trainable_scaling:
        # the file says false even when the modules hold a trained `scaling`.
        splora = {"r": RANK, "lora_alpha": SLTRAIN_ALPHA, "lora_dropout": 0.0,
                  "sp_ratio": SP_RATIO, "target_modules": ["attn", "mlp", "attention"],
                  "trainable_scaling": False}  # fmt: skip
        _write_flat(folder, {"config.json": cfg, "splora_config.json": splora},
                    _sltrain_tensors(g, bool(options.get("trainable_scaling"))))  # fmt: skip
    else:
        qkv = bool(options.get("qkv_up", False))
        ra, rm = options.get("attn_rank", RANK), options.get("mlp_rank", RANK)
        cfg = {**_llama_config(HEADS if qkv else 2), "is_llama_config": True, "attn_rank": ra,
               "mlp_rank": rm, "rope_theta": 10000.0, "tie_word_embeddings": False,
               "rope_interleaved": options.get("rope_interleaved", False)}  # fmt: skip
        cfg.pop("max_sequence_length")
        rows = frozenset(
            f"model.decoder.{i}.pp_block.attn.qkv_proj0.weight" for i in range(LAYERS)
        ) if options.get("row_parallel_qkv0") else frozenset()  # fmt: skip
        _write_nanotron(folder, cfg, _nanotron_tensors(g, qkv, ra, rm), rows)


def _slices(text: str) -> tuple[slice, ...]:
    """Nanotron's ``start,stop,step|...`` (serialize/metadata.py: SlicesPair) as slices."""
    return tuple(slice(*(None if x == "None" else int(x) for x in part.split(",")))
                 for part in text.split("|"))  # fmt: skip


def _merge(shards: list[tuple[torch.Tensor, dict[str, str]]]) -> torch.Tensor:
    """One tensor from its tp shards, each placed where its metadata says it belongs."""
    if len(shards) == 1 and "unsharded_shape" not in shards[0][1]:
        return shards[0][0]
    shape = tuple(int(n) for n in re.findall(r"\d+", shards[0][1]["unsharded_shape"]))
    full = torch.full(shape, float("nan"), dtype=shards[0][0].dtype)
    for t, meta in shards:
        for pair in meta["local_global_slices_pairs"].split(";"):
            local, glob = pair.split("#")
            full[_slices(glob)] = t[_slices(local)]
    assert not full.isnan().any(), "the shards do not cover the tensor"
    return full


def read_folder(folder: Path) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """(JSON configs, tensors) of a folder, flat or Nanotron's tree (shards merged)."""
    from safetensors import safe_open

    configs = {p.name: json.loads(p.read_text()) for p in folder.glob("*.json")}
    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    shards: dict[str, list[tuple[torch.Tensor, dict[str, str]]]] = {}
    for file in (
        sorted((folder / "model").rglob("*.safetensors")) if (folder / "model").is_dir() else []
    ):
        leaf = re.match(r"model_(.+?)(_pp-rank.*)?\.safetensors$", file.name)[1]
        key = ".".join((*file.relative_to(folder / "model").parent.parts, leaf))
        with safe_open(str(file), "pt") as f:
            shards.setdefault(key, []).append((f.get_tensor("data"), f.metadata() or {}))
    tensors.update({k: _merge(v) for k, v in shards.items()})
    return configs, tensors


# ---- the forwards, from each layout's published math ------------------------------------


@dataclass(frozen=True)
class Arch:
    """The Llama hyper-parameters a forward needs, from the folder's own config."""

    d: int
    heads: int
    kv: int
    head_dim: int
    layers: int
    eps: float
    theta: float
    interleaved: bool  # RoPE on even/odd pairs (Nanotron's rope_interleaved)
    gate_act: str  # the MLP's act(gate) * up: "silu", or "linear" (CoLA's only_lr_act)

    @classmethod
    def of(cls, cfg: dict[str, Any], *, theta: float | None = None, gate_act: str = "silu",
           interleaved: bool = False) -> Arch:  # fmt: skip
        d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if gate_act not in ("silu", "linear"):
            raise ValueError(f"the reference forwards know SiLU and linear, not {gate_act!r}")
        return cls(d, heads, cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or d // heads, cfg["num_hidden_layers"],
                   cfg.get("rms_norm_eps", EPS),
                   cfg.get("rope_theta", 10000.0) if theta is None else theta, interleaved,
                   gate_act)  # fmt: skip


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, a: Arch) -> torch.Tensor:
    """x [b, heads, s, hd]: GPT-NeoX halves (transformers, CoLA, LORO, SLTrain) or GPT-J
    even/odd pairs (Nanotron's rope_interleaved)."""
    f = torch.outer(torch.arange(x.shape[2]).float(), _inv_freq(a.theta, a.head_dim))
    if a.interleaved:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * torch.polar(torch.ones_like(f), f)).flatten(-2)
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Arch) -> torch.Tensor:
    b, s, _ = q.shape
    hd, rep = a.head_dim, a.heads // a.kv
    q = _rope(q.view(b, s, a.heads, hd).transpose(1, 2), a)
    k = _rope(k.view(b, s, a.kv, hd).transpose(1, 2), a).repeat_interleave(rep, 1)
    v = v.view(b, s, a.kv, hd).transpose(1, 2).repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / hd**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, a.heads * hd)


def _gate(a: Arch, gate: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) if a.gate_act == "silu" else gate


Proj = Callable[[int, str, torch.Tensor], torch.Tensor]


def _llama(ids: torch.Tensor, outside: dict[str, torch.Tensor], proj: Proj, a: Arch
           ) -> torch.Tensor:  # fmt: skip
    x = outside["embed"][ids]
    for i in range(a.layers):
        h = _rms(x, outside[f"ln1.{i}"], a.eps)
        x = x + proj(i, "o", _attention(proj(i, "q", h), proj(i, "k", h), proj(i, "v", h), a))
        h = _rms(x, outside[f"ln2.{i}"], a.eps)
        x = x + proj(i, "down", _gate(a, proj(i, "gate", h)) * proj(i, "up", h))
    return _rms(x, outside["norm"], a.eps) @ outside["head"].T


def _hf_outside(t: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    out = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"],
           "head": t.get("lm_head.weight", t["model.embed_tokens.weight"])}  # fmt: skip
    for i in range(layers):
        out[f"ln1.{i}"] = t[f"model.layers.{i}.input_layernorm.weight"]
        out[f"ln2.{i}"] = t[f"model.layers.{i}.post_attention_layernorm.weight"]
    return out


def _bias(t: dict, key: str, y: torch.Tensor, configured: bool) -> torch.Tensor:
    """CoLA's ``+ bias`` where its config builds one (``ColaLayer(bias=config.attention_bias)``
    / ``mlp_bias``); a bias tensor its config builds no parameter for would not be loaded
    by CoLA's own code, so the folder is wrong, not the forward."""
    if configured:
        return y + t[f"{key}.bias"]
    assert f"{key}.bias" not in t, f"{key}.bias: in the folder, but its config says no bias"
    return y


def _cola_arch(c: dict) -> Arch:
    # modeling_cola.py: every ColaLayer's lr_act is ACT2FN[hidden_act]; ColaMLP applies
    # act_fn to the gate unless only_lr_act (ColaConfig's default: True).
    assert c.get("hidden_act", "silu") == "silu", "the reference's lr_act is SiLU"
    return Arch.of(c, gate_act="linear" if c.get("only_lr_act", True) else "silu")


def _cola(t: dict, cfg: dict) -> Proj:
    # cola_layer.py, ColaLayer.forward: lr_act(x @ cola_a) @ cola_b (+ bias), lr_act = silu.
    c = cfg["config.json"]

    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        y = F.silu(h @ t[f"{key}.cola_a"]) @ t[f"{key}.cola_b"]
        return _bias(t, key, y, bool(c.get("mlp_bias" if p in _MLP else "attention_bias")))

    return proj


_MLP = ("gate", "up", "down")


def _colam_logits(ids: torch.Tensor, t: dict, cfg: dict) -> torch.Tensor:
    """modeling_colam.py's ColaMDecoderLayer.forward as written: the down projection's
    cola_b (and bias) applied by the next layer's last_layer_post_mlp (the last layer's
    post_mlp)."""
    c = cfg["config.json"]
    a = _cola_arch(c)
    o = _hf_outside(t, a.layers)
    attn_bias, mlp_bias = bool(c.get("attention_bias")), bool(c.get("mlp_bias"))

    def down(i: int, owner: str, p: str, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ t[f"model.layers.{i}.{owner}.pre_{p}_proj.cola_a"])

    def up(i: int, owner: str, p: str, x: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{owner}.post_{p}_proj"
        return _bias(t, key, x @ t[f"{key}.cola_b"], mlp_bias if p in _MLP else attn_bias)

    hidden, residual = o["embed"][ids], None
    for i in range(a.layers):
        if i > 0:  # checkpoint_cola_layer1 of a later layer
            hidden = up(i, "last_layer_post_mlp", "down", hidden) + residual
        residual = hidden
        h = _rms(hidden, o[f"ln1.{i}"], a.eps)
        q, k, v = (up(i, "self_attn", p, down(i, "pre_attn", p, h)) for p in "qkv")
        att = down(i, "self_attn", "o", _attention(q, k, v, a))
        hidden = up(i, "post_attn", "o", att) + residual
        residual = hidden
        h = _rms(hidden, o[f"ln2.{i}"], a.eps)
        gate = up(i, "self_mlp", "gate", down(i, "pre_mlp", "gate", h))
        upv = up(i, "self_mlp", "up", down(i, "pre_mlp", "up", h))
        hidden = down(i, "self_mlp", "down", _gate(a, gate) * upv)
    last = up(a.layers - 1, "post_mlp", "down", hidden)
    return _rms(last + residual, o["norm"], a.eps) @ o["head"].T


def _plus_bias(t: dict, key: str, y: torch.Tensor) -> torch.Tensor:
    """LORO's and SLTrain's modules keep the bias of the nn.Linear they replaced, if any."""
    return y + t[f"{key}.bias"] if f"{key}.bias" in t else y


def _loro(t: dict, cfg: dict) -> Proj:
    # lowrank_module.py, LowRankLinear.forward: x @ weight_in @ weight_out.T (+ bias); outside
    # --loro_scope the projection is the nn.Linear it was.
    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        if f"{key}.weight" in t:
            return _plus_bias(t, key, h @ t[f"{key}.weight"].T)
        return _plus_bias(t, key, h @ t[f"{key}.weight_in"] @ t[f"{key}.weight_out"].T)

    return proj


def _sltrain(t: dict, cfg: dict) -> Proj:
    # sparse_linear.cpp, sparse_linear_forward: W = B @ (A * scale);
    # W.view(-1).scatter_add_(0, sparse_index, sparse_value); x @ W^T (+ bias). scale:
    # SpLoRaLinear._post_lora_scale, tanh(scaling) where the module has a trained scaling,
    # else lora_alpha / r.
    splora = cfg["splora_config.json"]

    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        scaling = t.get(f"{key}.scaling")
        scale = scaling.tanh() if scaling is not None else splora["lora_alpha"] / splora["r"]
        w = t[f"{key}.lora_B"] @ (t[f"{key}.lora_A"] * scale)
        w.view(-1).scatter_add_(0, t[f"{key}.sparse_index"], t[f"{key}.sparse_value"])
        return _plus_bias(t, key, h @ w.T)

    return proj


def _nanotron_logits(ids: torch.Tensor, t: dict, cfg: dict) -> torch.Tensor:
    """The fork's attention and MLP: proj0 (down, [r, in]), SiLU, proj1 (up): the three
    q/k/v latents from one qkv_proj0, the up factors in q_proj1 and kv_proj1 (k, v), or
    all three in qkv_proj1; the MLP's act(gate) * up, or gate * up with only_lr_act."""
    c = cfg["model_config.json"]
    a = Arch.of(c, gate_act="linear" if c.get("only_lr_act", False) else "silu",
                interleaved=bool(c.get("rope_interleaved")))  # fmt: skip
    n = "model.decoder.{}.pp_block."
    o = {"embed": t["model.token_position_embeddings.pp_block.token_embedding.weight"],
         "norm": t["model.final_layer_norm.pp_block.weight"]}  # fmt: skip
    o["head"] = t.get("model.lm_head.pp_block.weight", o["embed"])  # a tied head: saved once
    for i in range(a.layers):
        o[f"ln1.{i}"] = t[n.format(i) + "input_layernorm.weight"]
        o[f"ln2.{i}"] = t[n.format(i) + "post_attention_layernorm.weight"]

    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        w = {k[len(n.format(i)) :]: v for k, v in t.items() if k.startswith(n.format(i))}
        if p in "qkv":
            lat = F.silu(h @ w["attn.qkv_proj0.weight"].T).chunk(3, -1)["qkv".index(p)]
            if "attn.qkv_proj1.weight" in w:
                return lat @ w["attn.qkv_proj1.weight"]["qkv".index(p)].T
            up = w["attn.q_proj1.weight"] if p == "q" else w["attn.kv_proj1.weight"]["kv".index(p)]
            return lat @ up.T
        if p in ("gate", "up"):
            j = ("gate", "up").index(p)
            lat = F.silu(h @ w["mlp.gate_up_proj0.weight"].T).chunk(2, -1)[j]
            return lat @ w["mlp.gate_up_proj1.weight"][j].T
        stem = "attn.o_proj" if p == "o" else "mlp.down_proj"
        return F.silu(h @ w[f"{stem}0.weight"].T) @ w[f"{stem}1.weight"].T

    return _llama(ids, o, proj, a)


def reference_logits(layout: str, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The layout's own forward on the folder's tensors, in float64 (rounding aside)."""
    configs, t = read_folder(folder)
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    with torch.no_grad():
        if layout == "cola-m":
            return _colam_logits(ids, t, configs)
        if layout == "boost-nanotron":
            return _nanotron_logits(ids, t, configs)
        c = configs["config.json"]
        if layout == "cola":
            a = _cola_arch(c)
        else:  # peft_pretraining/modeling_llama.py: RoPE base 10000, act_fn = hidden_act
            a = Arch.of(c, theta=10000.0, gate_act=c.get("hidden_act", "silu"))
        proj = {"cola": _cola, "loro": _loro, "sltrain": _sltrain}[layout](t, configs)
        return _llama(ids, _hf_outside(t, a.layers), proj, a)
