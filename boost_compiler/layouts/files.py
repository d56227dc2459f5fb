"""Tensors on disk: a folder's ``*.safetensors`` files, or a Nanotron checkpoint's tree.

Only safetensors are read (never a pickled ``pytorch_model.bin``: loading one can run
code). Two arrangements:

* flat: ``*.safetensors`` in the folder (``save_pretrained``'s, sharded or not), each key
  a tensor name;
* Nanotron's tree (``huggingface/nanotron``, ``src/nanotron/serialize/weights.py`` and
  ``serialize/utils.py:get_path``): ``model/<name with dots as folders>/model_<leaf>.safetensors``
  for a replicated parameter, ``model_<leaf>_pp-rank-P-of-Q_tp-rank-T-of-S.safetensors`` for
  a tensor-parallel one (tensor ``"data"``, and in the metadata the slices of the unsharded
  tensor it holds, ``local_global_slices_pairs``, as
  ``parallel/parameters.py:SlicesPair`` writes them), merged back into one tensor here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import LayoutError

__all__ = ["read_tensors", "tensor_files", "tensor_shapes", "write_output"]

_SHARD = re.compile(r"^model_(?P<leaf>.+?)(?:_pp-rank-\d+-of-\d+_tp-rank-(?P<tp>\d+)-of-(?P<tps>\d+))?"
                    r"(?:_exp-rank-\d+-of-\d+)?\.safetensors$")  # fmt: skip
NANOTRON_VERSION = "1.5"  # nanotron's CHECKPOINT_VERSION (src/nanotron/constants.py)


Stored = list[tuple[Path, str]]  # a tensor's files, and its name in each


def tensor_files(folder: Path) -> dict[str, Stored]:
    """Tensor name -> the files holding it (several: a Nanotron tensor's TP shards)."""
    from safetensors import safe_open

    files: dict[str, Stored] = {}
    flat = sorted(folder.glob("*.safetensors"))
    for file in flat:
        try:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())  # noqa: SIM118 (safe_open is not a Mapping)
        except Exception as err:  # safetensors' own error type: a truncated or foreign file
            raise LayoutError(f"{file}: not a readable safetensors file ({err})") from err
        for key in keys:
            files.setdefault(key, []).append((file, key))
    tree = folder / "model"
    if not flat and tree.is_dir():
        for file in sorted(tree.rglob("*.safetensors")):
            m = _SHARD.match(file.name)
            if m is None:
                raise LayoutError(f"{file}: not a Nanotron tensor file name (model_<name>...)")
            parts = file.relative_to(tree).parent.parts
            files.setdefault(".".join((*parts, m["leaf"])), []).append((file, "data"))
    if not files and any(folder.glob("*.bin")):
        raise LayoutError(
            f"{folder}: only pickled weights (*.bin), which boost never loads (unpickling can run "
            "code): save them as safetensors first (save_pretrained(..., "
            "safe_serialization=True), or safetensors.torch.save_file of the state dict)"
        )
    if not files:
        raise LayoutError(f"{folder}: no .safetensors weights (flat, or Nanotron's model/ tree)")
    return files


def _slices(text: str) -> tuple[slice, ...]:
    return tuple(slice(*(None if x == "None" else int(x) for x in s.split(",")))
                 for s in text.split("|"))  # fmt: skip


def _merge(key: str, stored: Stored) -> torch.Tensor:
    """One tensor from its files: the only one, or Nanotron shards placed by their slices."""
    from safetensors import safe_open

    parts = []
    for file, name in stored:
        with safe_open(str(file), framework="pt") as f:
            parts.append((f.get_tensor(name), f.metadata() or {}))
    if len(parts) == 1 and "local_global_slices_pairs" not in parts[0][1]:
        return parts[0][0]
    try:
        shape = tuple(int(x) for x in parts[0][1]["unsharded_shape"].strip("()").split(",") if x)
        full = torch.empty(shape, dtype=parts[0][0].dtype)
        filled = torch.zeros(shape, dtype=torch.bool)
        for t, meta in parts:
            for pair in meta["local_global_slices_pairs"].split(";"):
                local, glob = pair.split("#")
                full[_slices(glob)] = t[_slices(local)]
                filled[_slices(glob)] = True
    except (KeyError, ValueError, RuntimeError, IndexError) as err:
        raise LayoutError(f"{stored[0][0]}: shards of '{key}' whose metadata does not place "
                          f"them in one tensor ({type(err).__name__}: {err})") from err  # fmt: skip
    if not bool(filled.all()):
        raise LayoutError(f"{stored[0][0].parent}: the shards of '{key}' do not cover it (a "
                          "tensor-parallel rank's file is missing)")  # fmt: skip
    return full


def tensor_shapes(files: dict[str, Stored]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the files' headers (a Nanotron shard's ``unsharded_shape``):
    no tensor is read, so a config can be checked against them first."""
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for key, stored in files.items():
        for file, name in stored:
            by_file.setdefault(file, []).append((key, name))
    shapes: dict[str, tuple[int, ...]] = {}
    for file, entries in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                whole = (f.metadata() or {}).get("unsharded_shape")
                for key, name in entries:
                    shapes[key] = (tuple(int(x) for x in whole.strip("()").split(",") if x)
                                   if whole else tuple(f.get_slice(name).get_shape()))  # fmt: skip
        except Exception as err:  # safetensors' error, or an unsharded_shape that is no shape
            raise LayoutError(f"{file}: cannot read its tensors' shapes ({err})") from err
    return shapes


def read_tensors(files: dict[str, Stored]) -> dict[str, torch.Tensor]:
    """Every tensor by name (Nanotron's shards merged)."""
    return {key: _merge(key, stored) for key, stored in files.items()}


def _full_slices(shape: tuple[int, ...]) -> str:
    part = "|".join(f"0,{n},None" for n in shape)
    return f"{part}#{part}"


def write_output(
    out: str | Path,
    configs: dict[str, dict[str, Any]],
    tensors: dict[str, torch.Tensor],
    *,
    tree: bool = False,
    sharded: frozenset[str] = frozenset(),
) -> Path:
    """Write the JSON ``configs`` and the ``tensors`` to the folder ``out``: flat
    (``model.safetensors``) or as Nanotron's tree, where a key in ``sharded`` is written as
    tensor-parallel rank 0 of 1 (with the slices Nanotron's loader re-shards from)."""
    import json

    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for name, values in configs.items():
        (folder / name).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    if not tree:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    for key, t in tensors.items():
        *parts, leaf = key.split(".")
        where = folder.joinpath("model", *parts)
        where.mkdir(parents=True, exist_ok=True)
        if key in sharded:
            meta = {"version": NANOTRON_VERSION, "local_global_slices_pairs":
                    _full_slices(tuple(t.shape)), "unsharded_shape": str(tuple(t.shape))}  # fmt: skip
            save_file({"data": t}, str(where / f"model_{leaf}_pp-rank-0-of-1_tp-rank-0-of-1"
                                       ".safetensors"), metadata=meta)  # fmt: skip
        else:
            save_file({"data": t}, str(where / f"model_{leaf}.safetensors"))
    return folder
