"""Which of ``to_low_rank``'s candidate layers are the output head, found by role (the layer
a token embedding is tied to, or that maps the hidden size back onto the vocabulary), never
by name: those stay dense unless named explicitly. Ambiguous cases keep every layer and
say so; none is guessed."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("boost_compiler.convert")


def _dims(mod: nn.Module, conv1d: type | None) -> tuple[str, int, int]:
    if conv1d is not None and isinstance(mod, conv1d):
        d_in, d_out = mod.weight.shape  # Conv1D stores [in, out]
        return "Conv1D", int(d_in), int(d_out)
    return type(mod).__name__, int(mod.in_features), int(mod.out_features)


def _heads(
    model: nn.Module, candidates: dict[str, nn.Module], conv1d: type | None
) -> dict[str, str]:
    """Candidates that are the output head by role, with why (never by their name).

    The head is the projection onto the vocabulary, found from what the model says:

    1. a layer whose weight *is* an embedding's weight (tied; it cannot be factored
       without untying it);
    2. the module the model's ``get_output_embeddings()`` returns (Hugging Face).

    A model whose ``get_output_embeddings()`` returns a module has said which its head
    is: nothing else is one. Sizes alone are no proof there: in a GPT-2 with
    ``n_positions == n_embd`` and ``vocab_size == 4 * n_embd``, every block's
    ``attn.c_proj`` maps ``d`` onto as many outputs as the positions table has rows,
    and ``mlp.c_fc`` as many as the token table.

    Only a model that does not say (Meta's Llama and torchtitan's ``output``, plain
    modules) falls back to a structural rule, :func:`_head_by_structure`: the one
    layer outside the repeated blocks that maps a token embedding's width onto its
    number of rows.
    """
    embeds = {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    by_weight = {id(m.weight): n for n, m in embeds.items()}
    out_emb = _hf_embeddings(model, "get_output_embeddings")
    heads: dict[str, str] = {}
    dense = "dense by default; include it by name to convert"
    for name, mod in candidates.items():
        tied = by_weight.get(id(mod.weight))
        if tied is not None:
            heads[name] = f"weight tied to embedding '{tied}'"
        elif mod is out_emb:
            heads[name] = f"output head (get_output_embeddings(); {dense})"
    if out_emb is None:
        found = _head_by_structure(model, candidates, conv1d, embeds)
        if found is not None and found[0] not in heads:
            name, emb, rows = found
            heads[name] = f"output head (projects onto the {rows} rows of '{emb}'; {dense})"
    return heads


def _hf_embeddings(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` where it gives a module."""
    get = getattr(model, getter, None)
    if not callable(get):
        return None
    try:
        found = get()
    except Exception:  # some HF models raise NotImplementedError here
        return None
    return found if isinstance(found, nn.Module) else None


def _in_repeated_block(name: str, modules: dict[str, nn.Module]) -> bool:
    """Whether module ``name`` is, or sits inside, an element of a stack of blocks: an
    ``nn.ModuleList``, or an ``nn.ModuleDict`` of two or more modules of one type
    (torchtitan keeps its layers in one; nanoGPT's ``transformer`` dict of embeddings,
    blocks and norm is no stack). A model's head runs once, after its blocks."""
    parts = name.split(".")
    for i in range(len(parts)):
        parent = modules.get(".".join(parts[:i]))
        if isinstance(parent, nn.ModuleList):
            return True
        if isinstance(parent, nn.ModuleDict) and len(parent) > 1:
            if len({type(m) for m in parent.values()}) == 1:
                return True
    return False


def _head_by_structure(
    model: nn.Module,
    candidates: dict[str, nn.Module],
    conv1d: type | None,
    embeds: dict[str, nn.Embedding],
) -> tuple[str, str, int] | None:
    """``(name, embedding, rows)`` of the one head-shaped layer, for models that do not say.

    The token table is ``get_input_embeddings()`` where the model has one, else every
    embedding outside the repeated blocks. A head maps a token table's width ``d``
    onto its ``V`` rows, and is no layer of a repeated block (a block's ``d -> 4d``
    may equal ``V`` by chance; a head runs once, after the blocks). More than one such
    layer: none is called the head (each stays a candidate, and the log says so).
    """
    modules = dict(model.named_modules())
    given = _hf_embeddings(model, "get_input_embeddings")
    named = {id(m): n for n, m in modules.items()}
    if given is not None:
        weight = getattr(given, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or id(given) not in named:
            return None
        tables = {named[id(given)]: (int(weight.shape[1]), int(weight.shape[0]))}
    else:
        tables = {
            n: (m.embedding_dim, m.num_embeddings)
            for n, m in embeds.items() if not _in_repeated_block(n, modules)
        }  # fmt: skip
    by_size = {size: n for n, size in tables.items()}
    found = []
    for name, mod in candidates.items():
        _, d_in, d_out = _dims(mod, conv1d)
        if (d_in, d_out) in by_size and not _in_repeated_block(name, modules):
            found.append((name, by_size[(d_in, d_out)], d_out))
    if len(found) > 1:
        log.warning(
            "to_low_rank: %s each map a token embedding's width onto its rows: none is taken "
            "for the output head (exclude= the one that is, to keep it dense)",
            ", ".join(repr(n) for n, _, _ in found),
        )
    return found[0] if len(found) == 1 else None
