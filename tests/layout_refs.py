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


def _inv_freq(theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, HD, 2).float() / HD))


# ---- the folders, in each project's own names ---------------------------------------------


def _cola_tensors(g: Gen) -> dict[str, torch.Tensor]:
    t = _outside(g)
    for i in range(LAYERS):
        for p, (d_in, d_out) in _dims(HEADS).items():
            t[f"model.layers.{i}.{PROJ[p]}.cola_a"] = g(d_in, RANK, std=d_in**-0.5)
            t[f"model.layers.{i}.{PROJ[p]}.cola_b"] = g(RANK, d_out, std=RANK**-0.5)
    return t


def _colam_name(key: str) -> str:
    """CoLA's key in CoLA-M's modules (cola/modeling_colam.py): q/k/v/gate/up/o/down split
    into pre_* (cola_a) and post_* (cola_b), down's cola_b one layer later."""
    m = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(cola_a|cola_b)$", key)
    if m is None:
        return key
    i, p, leaf = int(m[1]), m[3], m[4]
    if leaf == "cola_a":
        owner = {"q": "pre_attn", "k": "pre_attn", "v": "pre_attn", "o": "self_attn",
                 "gate": "pre_mlp", "up": "pre_mlp", "down": "self_mlp"}[p]  # fmt: skip
        return f"model.layers.{i}.{owner}.pre_{p}_proj.cola_a"
    if p == "down":
        if i == LAYERS - 1:
            return f"model.layers.{i}.post_mlp.post_down_proj.cola_b"
        return f"model.layers.{i + 1}.last_layer_post_mlp.post_down_proj.cola_b"
    owner = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "post_attn",
             "gate": "self_mlp", "up": "self_mlp"}[p]  # fmt: skip
    return f"model.layers.{i}.{owner}.post_{p}_proj.cola_b"


def _loro_tensors(g: Gen) -> dict[str, torch.Tensor]:
    t = _outside(g)
    for i in range(LAYERS):
        t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = _inv_freq()
        for p, (d_in, d_out) in _dims(KV_HEADS["loro"]).items():
            t[f"model.layers.{i}.{PROJ[p]}.weight_in"] = g(d_in, RANK, std=d_in**-0.5)
            t[f"model.layers.{i}.{PROJ[p]}.weight_out"] = g(d_out, RANK, std=RANK**-0.5)
    return t


def _sltrain_tensors(g: Gen) -> dict[str, torch.Tensor]:
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
    return t


def _nanotron_tensors(g: Gen) -> dict[str, torch.Tensor]:
    kv = KV_HEADS["boost-nanotron"] * HD
    t = {"model.token_position_embeddings.pp_block.token_embedding.weight": g(VOCAB, D, std=1.0),
         "model.final_layer_norm.pp_block.weight": 1 + g(D, std=0.1),
         "model.lm_head.pp_block.weight": g(VOCAB, D, std=D**-0.5)}  # fmt: skip
    for i in range(LAYERS):
        p = f"model.decoder.{i}.pp_block"
        t[f"{p}.input_layernorm.weight"] = 1 + g(D, std=0.1)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + g(D, std=0.1)
        t[f"{p}.attn.qkv_proj0.weight"] = g(3 * RANK, D, std=D**-0.5)
        t[f"{p}.attn.q_proj1.weight"] = g(HEADS * HD, RANK, std=RANK**-0.5)
        t[f"{p}.attn.kv_proj1.weight"] = g(2, kv, RANK, std=RANK**-0.5)
        t[f"{p}.attn.o_proj0.weight"] = g(RANK, HEADS * HD, std=D**-0.5)
        t[f"{p}.attn.o_proj1.weight"] = g(D, RANK, std=RANK**-0.5)
        t[f"{p}.mlp.gate_up_proj0.weight"] = g(2 * RANK, D, std=D**-0.5)
        t[f"{p}.mlp.gate_up_proj1.weight"] = g(2, FF, RANK, std=RANK**-0.5)
        t[f"{p}.mlp.down_proj0.weight"] = g(RANK, FF, std=FF**-0.5)
        t[f"{p}.mlp.down_proj1.weight"] = g(D, RANK, std=RANK**-0.5)
    return t


def _write_flat(folder: Path, configs: dict[str, dict], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for name, cfg in configs.items():
        (folder / name).write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))


def _write_nanotron(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Nanotron's tree as a tp=2 run saves it (serialize/weights.py): norms replicated, every
    other tensor in two shards along its first dimension with the slices it holds."""
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
        half, rest = t.shape[0] // 2, "|".join("None,None,None" for _ in t.shape[1:])
        for rank in range(2):
            meta = {"version": "1.4", "unsharded_shape": str(tuple(t.shape)),
                    "local_global_slices_pairs": f"0,{half},None|{rest}#"
                    f"{rank * half},{(rank + 1) * half},None|{rest}"}  # fmt: skip
            shard = t[rank * half : (rank + 1) * half].contiguous()
            name = f"model_{leaf}_pp-rank-0-of-1_tp-rank-{rank}-of-2.safetensors"
            save_file({"data": shard}, str(where / name), metadata=meta)


def write_folder(layout: str, folder: Path, seed: int = 0, **options: Any) -> None:
    """A tiny ``layout`` folder of random weights, as that project's own code saves it."""
    g = Gen(seed)
    if layout in ("cola", "cola-m"):
        model_type = {"cola": "cola", "cola-m": "cola_m"}[layout]
        arch = {"cola": "ColaForCausalLM", "cola-m": "ColaMForCausalLM"}[layout]
        cfg = _llama_config(HEADS, model_type=model_type, architectures=[arch], rank=RANK,
                            only_lr_act=False, pad_token_id=0)  # fmt: skip
        t = _cola_tensors(g)
        if layout == "cola-m":
            t = {_colam_name(k): v for k, v in t.items()}
        _write_flat(folder, {"config.json": cfg}, t)
    elif layout == "loro":
        cfg = _llama_config(2, model_type="llama", architectures=["LLaMAForCausalLM"],
                            pad_token_id=-1)  # configs/llama_60m.json's  # fmt: skip
        _write_flat(folder, {"config.json": cfg}, _loro_tensors(g))
    elif layout == "sltrain":
        cfg = _llama_config(2, model_type="llama", architectures=["LLaMAForCausalLM"],
                            pad_token_id=-1)  # fmt: skip
        splora = {"r": RANK, "lora_alpha": SLTRAIN_ALPHA, "lora_dropout": 0.0,
                  "sp_ratio": SP_RATIO, "target_modules": ["attn", "mlp", "attention"]}  # fmt: skip
        _write_flat(folder, {"config.json": cfg, "splora_config.json": splora},
                    _sltrain_tensors(g))  # fmt: skip
    else:
        cfg = {**_llama_config(2), "is_llama_config": True, "attn_rank": RANK, "mlp_rank": RANK,
               "rope_theta": 10000.0, "tie_word_embeddings": False,
               "rope_interleaved": options.get("rope_interleaved", False)}  # fmt: skip
        cfg.pop("max_sequence_length")
        _write_nanotron(folder, cfg, _nanotron_tensors(g))


def read_folder(folder: Path) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """(JSON configs, tensors) of a folder, flat or Nanotron's tree (shards merged)."""
    from safetensors import safe_open

    configs = {p.name: json.loads(p.read_text()) for p in folder.glob("*.json")}
    tensors: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    shards: dict[str, list[torch.Tensor]] = {}
    for file in (
        sorted((folder / "model").rglob("*.safetensors")) if (folder / "model").is_dir() else []
    ):
        leaf = re.match(r"model_(.+?)(_pp-rank.*)?\.safetensors$", file.name)[1]
        key = ".".join((*file.relative_to(folder / "model").parent.parts, leaf))
        with safe_open(str(file), "pt") as f:
            shards.setdefault(key, []).append(f.get_tensor("data"))  # tp ranks in order
    tensors.update({k: torch.cat(v) if len(v) > 1 else v[0] for k, v in shards.items()})
    return configs, tensors


# ---- the forwards, from each layout's published math ------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [b, heads, s, hd]: GPT-NeoX halves (transformers, CoLA, LORO, SLTrain) or GPT-J
    even/odd pairs (Nanotron's rope_interleaved)."""
    f = torch.outer(torch.arange(x.shape[2]).float(), _inv_freq())  # [s, hd/2]
    if interleaved:
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * torch.polar(torch.ones_like(f), f)).flatten(-2)
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: int, inter: bool
) -> torch.Tensor:
    b, s, _ = q.shape
    q = _rope(q.view(b, s, HEADS, HD).transpose(1, 2), inter)
    k = _rope(k.view(b, s, kv, HD).transpose(1, 2), inter).repeat_interleave(HEADS // kv, 1)
    v = v.view(b, s, kv, HD).transpose(1, 2).repeat_interleave(HEADS // kv, 1)
    scores = q @ k.transpose(-1, -2) / HD**0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, HEADS * HD)


Proj = Callable[[int, str, torch.Tensor], torch.Tensor]


def _llama(ids: torch.Tensor, outside: dict[str, torch.Tensor], proj: Proj, kv: int,
           interleaved: bool = False) -> torch.Tensor:  # fmt: skip
    x = outside["embed"][ids]
    for i in range(LAYERS):
        h = _rms(x, outside[f"ln1.{i}"])
        a = _attention(proj(i, "q", h), proj(i, "k", h), proj(i, "v", h), kv, interleaved)
        x = x + proj(i, "o", a)
        h = _rms(x, outside[f"ln2.{i}"])
        x = x + proj(i, "down", F.silu(proj(i, "gate", h)) * proj(i, "up", h))
    return _rms(x, outside["norm"]) @ outside["head"].T


def _hf_outside(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"embed": t["model.embed_tokens.weight"], "norm": t["model.norm.weight"],
           "head": t["lm_head.weight"]}  # fmt: skip
    for i in range(LAYERS):
        out[f"ln1.{i}"] = t[f"model.layers.{i}.input_layernorm.weight"]
        out[f"ln2.{i}"] = t[f"model.layers.{i}.post_attention_layernorm.weight"]
    return out


def _cola(t: dict, cfg: dict) -> Proj:
    # cola_layer.py, ColaLayer.forward: lr_act(x @ cola_a) @ cola_b (+ bias), lr_act = silu.
    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        return F.silu(h @ t[f"{key}.cola_a"]) @ t[f"{key}.cola_b"]

    return proj


def _colam_logits(ids: torch.Tensor, t: dict, cfg: dict) -> torch.Tensor:
    """modeling_colam.py's ColaMDecoderLayer.forward as written: the down projection's
    cola_b applied by the next layer's last_layer_post_mlp (the last layer's post_mlp)."""
    o = _hf_outside(t)

    def down(i: int, owner: str, p: str, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ t[f"model.layers.{i}.{owner}.pre_{p}_proj.cola_a"])

    def up(i: int, owner: str, p: str, x: torch.Tensor) -> torch.Tensor:
        return x @ t[f"model.layers.{i}.{owner}.post_{p}_proj.cola_b"]

    hidden, residual = o["embed"][ids], None
    for i in range(LAYERS):
        if i > 0:  # checkpoint_cola_layer1 of a later layer
            hidden = hidden @ t[f"model.layers.{i}.last_layer_post_mlp.post_down_proj.cola_b"]
            hidden = hidden + residual
        residual = hidden
        h = _rms(hidden, o[f"ln1.{i}"])
        q, k, v = (up(i, "self_attn", p, down(i, "pre_attn", p, h)) for p in "qkv")
        a = down(i, "self_attn", "o", _attention(q, k, v, HEADS, False))
        hidden = up(i, "post_attn", "o", a) + residual
        residual = hidden
        h = _rms(hidden, o[f"ln2.{i}"])
        gate = up(i, "self_mlp", "gate", down(i, "pre_mlp", "gate", h))
        upv = up(i, "self_mlp", "up", down(i, "pre_mlp", "up", h))
        hidden = down(i, "self_mlp", "down", F.silu(gate) * upv)
    last = f"model.layers.{LAYERS - 1}.post_mlp.post_down_proj.cola_b"
    return _rms(hidden @ t[last] + residual, o["norm"]) @ o["head"].T


def _loro(t: dict, cfg: dict) -> Proj:
    # lowrank_module.py, LowRankLinear.forward: x @ weight_in @ weight_out.T (+ bias).
    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        return h @ t[f"{key}.weight_in"] @ t[f"{key}.weight_out"].T

    return proj


def _sltrain(t: dict, cfg: dict) -> Proj:
    # sparse_linear.cpp, sparse_linear_forward: W = B @ (A * lora_alpha / r);
    # W.view(-1).scatter_add_(0, sparse_index, sparse_value); x @ W^T (+ bias).
    scale = cfg["splora_config.json"]["lora_alpha"] / cfg["splora_config.json"]["r"]

    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        key = f"model.layers.{i}.{PROJ[p]}"
        w = t[f"{key}.lora_B"] @ (t[f"{key}.lora_A"] * scale)
        w.view(-1).scatter_add_(0, t[f"{key}.sparse_index"], t[f"{key}.sparse_value"])
        return h @ w.T

    return proj


def _nanotron_logits(ids: torch.Tensor, t: dict, cfg: dict) -> torch.Tensor:
    """The fork's attention and MLP: proj0 (down, [r, in]), SiLU, proj1 (up): the three
    q/k/v latents from one qkv_proj0, k and v up factors batched in kv_proj1."""
    c = cfg["model_config.json"]
    n = "model.decoder.{}.pp_block."
    o = {"embed": t["model.token_position_embeddings.pp_block.token_embedding.weight"],
         "norm": t["model.final_layer_norm.pp_block.weight"],
         "head": t["model.lm_head.pp_block.weight"]}  # fmt: skip
    for i in range(LAYERS):
        o[f"ln1.{i}"] = t[n.format(i) + "input_layernorm.weight"]
        o[f"ln2.{i}"] = t[n.format(i) + "post_attention_layernorm.weight"]

    def proj(i: int, p: str, h: torch.Tensor) -> torch.Tensor:
        w = {k[len(n.format(i)) :]: v for k, v in t.items() if k.startswith(n.format(i))}
        if p in "qkv":
            lat = F.silu(h @ w["attn.qkv_proj0.weight"].T).chunk(3, -1)["qkv".index(p)]
            up = w["attn.q_proj1.weight"] if p == "q" else w["attn.kv_proj1.weight"]["kv".index(p)]
            return lat @ up.T
        if p in ("gate", "up"):
            j = ("gate", "up").index(p)
            lat = F.silu(h @ w["mlp.gate_up_proj0.weight"].T).chunk(2, -1)[j]
            return lat @ w["mlp.gate_up_proj1.weight"][j].T
        stem = "attn.o_proj" if p == "o" else "mlp.down_proj"
        return F.silu(h @ w[f"{stem}0.weight"].T) @ w[f"{stem}1.weight"].T

    return _llama(ids, o, proj, c["num_key_value_heads"], bool(c.get("rope_interleaved")))


def reference_logits(layout: str, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The layout's own forward on the folder's tensors, in float64 (rounding aside)."""
    configs, t = read_folder(folder)
    t = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    with torch.no_grad():
        if layout == "cola-m":
            return _colam_logits(ids, t, configs)
        if layout == "boost-nanotron":
            return _nanotron_logits(ids, t, configs)
        proj = {"cola": _cola, "loro": _loro, "sltrain": _sltrain}[layout](t, configs)
        return _llama(ids, _hf_outside(t), proj, KV_HEADS[layout])
