"""DCP checkpoints of a (pp, dp, tp) training run that load at any other (pp, dp, tp).

What is saved (``torch.distributed.checkpoint``), under the single-device names
(``model.<fqn>``, ``optim.<state>.<fqn>``, ``optim.step``, ``rng.cpu``), every
tensor with its GLOBAL, single-device shape:

* a TP-sharded parameter (plain ``S(d)`` placement from ``parallelize``) and its
  AdamW moments: a ``DTensor`` on the tp mesh with ``Shard(d)``, whose local part is
  this tp rank's block. DCP writes each block once (the dp replicas of a block are
  de-duplicated by its planner) and reads any other blocking back: that is what
  makes a tp=2 checkpoint load at tp=1 or tp=4.
* a TP-replicated parameter, a *blocked* shard (fused q/k/v: rank i holds a slice
  of every block, which no DTensor placement describes) and buffers: the plain
  global tensor, identical on every rank (blocked shards are all-gathered over tp
  first); DCP writes one copy.

Pipeline stages (pp > 1) change nothing in this format: a stage's layout holds only
its own parameters, still under their single-device names (``layers.3...``), so each
stage writes its layers and DCP's metadata is the union over the stages; the layout's
``keys`` are the whole model's (what ``train_state.json`` records and a load checks),
and a load asks DCP only for this rank's stage.

FSDP2 shards every parameter once more over dp (``Shard(0)`` of the TP block).
Those are all-gathered over dp before saving (``full_tensor``) and split again on
load. **Memory cost, honestly:** during a save or load each rank holds, besides the
model, its full TP block (1/tp of a sharded tensor, all of a replicated one) of the
parameters and of both AdamW moments: up to 3/tp of the model's fp32 size extra,
not 3/(dp*tp). Describing the dp split too (a strided 2-D DTensor) would remove that;
at the sizes trained here the simple route wins.

Atomicity: every rank writes into ``DIR/step_N.tmp``; after a barrier rank 0
writes ``train_state.json`` (step, data position, config, key names) and renames
the folder to ``DIR/step_N``. A checkpoint is complete iff its folder is named
``step_N`` and holds DCP's ``.metadata``, ``train_state.json`` and ``manifest.json``;
:func:`latest` only considers complete ones, so a crash at any point of a save leaves
the previous checkpoint as the latest. :func:`latest_valid` (what ``--resume`` uses)
also says why it passed over each newer ``step_N``: a file deleted after the save, a
payload that differs from the manifest, unsafe metadata, a malformed
``train_state.json``. The folder must be shared by all ranks (as DCP's file writer
requires anyway).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from .._logging import get_logger
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    UnsafeCheckpointError,
)
from ..parallel.shadow import parallel_state
from ..tp.placement import Placement, R
from . import integrity
from .train_state import STATE_FILE, STEP_DIR, check_shapes, read_state

log = get_logger(__name__)

_STEP_DIR = STEP_DIR
# What a finished save holds besides its payloads; the manifest is written last.
_FINISHED = (integrity.METADATA, STATE_FILE, integrity.MANIFEST)
# No run takes more steps than this: a larger "step" is a damaged or forged train_state.json.


@dataclass
class Entry:
    """One parameter: its single-device name, live tensor, TP placement and global shape."""

    name: str
    param: torch.Tensor  # plain TP block, or an FSDP2 DTensor (Shard(0) over dp) of it
    placement: Placement
    global_shape: tuple[int, ...]


@dataclass
class Layout:
    """How the model's parameters are laid out on this rank, for save/load/clip."""

    entries: list[Entry]
    buffers: dict[str, torch.Tensor]
    keys: list[str]  # the whole single-device model's state_dict keys (a pp stage's too)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> first name
    tp_mesh: Any = None  # 1-D DeviceMesh, or None when tp == 1

    @property
    def tp(self) -> int:
        return 1 if self.tp_mesh is None else self.tp_mesh.size()


def model_layout(model: nn.Module, tp_mesh: Any = None) -> Layout:
    """The layout of a (possibly parallelized, possibly FSDP2-wrapped) model."""
    state = parallel_state(model)
    plan = state.plan if state is not None else None
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    params: dict[str, torch.Tensor] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        if id(prm) in first:
            aliases[name] = first[id(prm)]
            continue
        first[id(prm)] = name
        params[name] = prm
    keys = list(model.state_dict().keys())
    buffers = {k: b for k, b in model.named_buffers() if k in keys}
    entries = []
    for name, prm in params.items():
        placement = plan.params.get(name, R) if plan is not None else R
        shape = tuple(plan.param_shapes.get(name, prm.shape)) if plan else tuple(prm.shape)
        entries.append(Entry(name, prm, placement, shape))
    return Layout(entries, buffers, keys, aliases, tp_mesh if plan is not None else None)


# -- conversions: live tensor <-> TP block <-> checkpoint tensor ------------------------


def _tp_block(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP block, whole: an FSDP2 DTensor is all-gathered over dp (a collective)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t.detach()


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _as_dtensor(block: torch.Tensor, entry: Entry, mesh: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        block.contiguous(), mesh, [Shard(entry.placement.dim)], run_check=False,
        shape=torch.Size(entry.global_shape), stride=_contiguous_stride(entry.global_shape),
    )  # fmt: skip


def _uses_dtensor(entry: Entry, layout: Layout) -> bool:
    return layout.tp > 1 and entry.placement.is_shard and not entry.placement.blocks


def _saved(block: torch.Tensor, entry: Entry, layout: Layout) -> torch.Tensor:
    """The checkpoint form of a TP block (see the module docstring)."""
    if layout.tp == 1 or not entry.placement.is_shard:
        return block
    if not entry.placement.blocks:
        return _as_dtensor(block, entry, layout.tp_mesh)
    pg = layout.tp_mesh.get_group()
    parts = [torch.empty_like(block) for _ in range(layout.tp)]
    dist.all_gather(parts, block.contiguous(), group=pg)
    return entry.placement.unshard(parts)


def _template(entry: Entry, like: torch.Tensor, layout: Layout) -> torch.Tensor:
    """An empty tensor of the checkpoint form (``like``'s dtype and device), for ``dcp.load``."""
    kw = {"dtype": like.dtype, "device": like.device}
    if _uses_dtensor(entry, layout):
        local = list(entry.global_shape)
        local[entry.placement.dim] //= layout.tp
        return _as_dtensor(torch.empty(local, **kw), entry, layout.tp_mesh)
    return torch.empty(entry.global_shape, **kw)


def _block_of(loaded: torch.Tensor, entry: Entry, layout: Layout) -> torch.Tensor:
    """The TP block this rank keeps from a loaded checkpoint tensor."""
    if _uses_dtensor(entry, layout):
        return loaded.to_local()  # type: ignore[attr-defined]
    if layout.tp > 1 and entry.placement.is_shard:  # blocked: every logical block's slice
        rank = layout.tp_mesh.get_local_rank()
        return entry.placement.shard(loaded, rank, layout.tp)
    return loaded


def _assign(target: torch.Tensor, block: torch.Tensor, name: str) -> None:
    """Copy a TP block into a live tensor; an FSDP2 DTensor takes its dp piece of it."""
    local = target
    placements = getattr(target, "placements", None)
    if placements is not None:
        (placement,) = placements  # FSDP2 over a 1-D dp mesh: Shard(0)
        mesh = target.device_mesh  # type: ignore[attr-defined]
        dim = placement.dim
        n, rank = mesh.size(), mesh.get_local_rank()
        chunks = torch.chunk(block, n, dim=dim)  # FSDP2's own split (torch.chunk, padded)
        block = chunks[rank] if rank < len(chunks) else block.narrow(dim, 0, 0)
        local = target.to_local()  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(block.shape):
        raise CheckpointError(
            f"'{name}': checkpoint block {tuple(block.shape)} != {tuple(local.shape)}"
        )
    with torch.no_grad():
        local.copy_(block)


# -- optimizer state ---------------------------------------------------------------------


def _moment_keys(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
    """Per-parameter state tensors shaped like the parameter (AdamW: exp_avg, exp_avg_sq)."""
    state = opt.state.get(p, {})
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state now (zeros), as its first step would: so a load can fill it."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                continue
            state = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            opt.state[p] = state


def _items(layout: Layout, opt: torch.optim.Optimizer) -> Iterator[tuple[str, Entry, torch.Tensor]]:
    """(checkpoint key, entry, live tensor) for every parameter and moment, in a fixed order."""
    for e in layout.entries:
        yield f"model.{e.name}", e, e.param
    for e in layout.entries:
        for k in sorted(_moment_keys(opt, e.param)):
            yield f"optim.{k}.{e.name}", e, opt.state[e.param][k]


def _optim_step(opt: torch.optim.Optimizer) -> torch.Tensor:
    for state in opt.state.values():
        step = state.get("step")
        if step is not None:
            return torch.as_tensor(step, dtype=torch.float32).detach().clone().cpu()
    return torch.tensor(0.0)


# -- save / latest / load -------------------------------------------------------------------


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    best: tuple[int, Path] | None = None
    if not root.is_dir():
        return None
    for path in root.iterdir():
        m = _STEP_DIR.match(path.name)
        if m and is_complete(path) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), path)
    return None if best is None else best[1]


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints under ``root``; the removed."""
    steps = sorted(
        (int(m.group(1)), p)
        for p in Path(root).iterdir()
        if (m := _STEP_DIR.match(p.name)) and is_complete(p)
    )
    removed = [p for _, p in steps[:-keep]] if keep > 0 else []
    for path in removed:
        shutil.rmtree(path)
        log.info("removed checkpoint %s (--keep %d)", path, keep)
    return removed


def is_complete(path: Path) -> bool:
    """All files of a finished save are there (whether they are intact is :func:`checked`)."""
    return not missing_files(path)


def missing_files(path: Path) -> list[str]:
    """Which of a finished save's own files (``.metadata``, ``train_state.json``,
    ``manifest.json``) ``path`` lacks."""
    return [name for name in _FINISHED if not (path / name).is_file()]


def checked(path: Path) -> Any:
    """The DCP metadata of ``path`` once every file matches its manifest and its
    ``train_state.json`` is well-formed (else an error naming the file and field);
    unpickled with DCP's own classes only."""
    integrity.verify(path)
    metadata = integrity.read_metadata(path)
    read_state(path)
    return metadata


def latest_valid(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that passes :func:`checked`, and why each newer
    one was skipped (incomplete, corrupted, unsafe); ``(None, reasons)`` if none passes.

    A ``step_N`` folder lacking one of a finished save's files is reported, not ignored: a
    save only renames ``step_N.tmp`` to ``step_N`` once they are all written, so such a
    folder lost a file afterwards. ``step_N.tmp`` (a save cut short) is passed over quietly.
    """
    root = Path(root)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            m = _STEP_DIR.match(path.name)
            if m and path.is_dir():
                found.append((int(m.group(1)), path))
    skipped: list[str] = []
    for _, path in sorted(found, reverse=True):
        missing = missing_files(path)
        try:
            if missing:
                raise CheckpointCorruptError(
                    f"{path}: incomplete: missing {', '.join(missing)} (deleted after the save "
                    "finished; a save renames step_N.tmp to step_N only once all are written)"
                )
            checked(path)
        except (CheckpointCorruptError, UnsafeCheckpointError) as exc:
            log.warning("skipping checkpoint %s: %s", path, exc)
            skipped.append(str(exc))
            continue
        return path, skipped
    return None, skipped


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: str | Path,
    step: int,
    layout: Layout,
    opt: torch.optim.Optimizer,
    train_state: dict[str, Any],
) -> Path:
    """Write ``root/step_<step>`` atomically (a collective: every rank calls it)."""
    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier save of this step
            shutil.rmtree(tmp)
    dist.barrier()
    sd: dict[str, Any] = {}
    for key, entry, live in _items(layout, opt):
        sd[key] = _saved(_tp_block(live), entry, layout)
    sd.update({f"model.{k}": b.detach() for k, b in layout.buffers.items()})
    sd["optim.step"] = _optim_step(opt)
    sd["rng.cpu"] = torch.get_rng_state()
    dcp.save(sd, checkpoint_id=tmp)
    del sd
    dist.barrier()
    if rank == 0:
        state = {
            **train_state,
            "step": step,
            "keys": layout.keys,
            "aliases": layout.aliases,
            "moments": sorted(_moment_keys(opt, layout.entries[0].param)) if layout.entries else [],
        }
        with open(tmp / STATE_FILE, "w") as f:
            json.dump(state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        integrity.write_manifest(tmp)  # last: a folder with a manifest is a finished save
        _fsync_dir(tmp)
        stale = root / f"step_{step}.stale"
        if final.exists():  # re-saving a step (a rerun without --resume): replace it
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
        tmp.rename(final)
        _fsync_dir(root)
        shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    log.info("saved checkpoint %s", final)
    return final


def resolve(path: str | Path) -> Path:
    """A step folder, or a run folder (-> its newest complete checkpoint that is intact)."""
    path = Path(path)
    missing = missing_files(path)
    if not missing:
        return path
    if _STEP_DIR.match(path.name) or len(missing) < len(_FINISHED):
        raise CheckpointCorruptError(
            f"{path}: not a finished checkpoint ({', '.join(missing)} missing: the save was "
            "interrupted, a file was deleted, or the folder was not written by boost train)"
        )
    found, skipped = latest_valid(path)
    if found is None:
        why = f"; skipped: {'; '.join(skipped)}" if skipped else ""
        raise CheckpointError(f"no complete, intact checkpoint (step_N) under {path}{why}")
    return found


def load(path: str | Path, layout: Layout, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint saved at any (pp, dp, tp) into this rank's model and optimizer.

    Returns the ``train_state.json`` dict (step, data position, config). A collective.
    """
    path = resolve(path)
    metadata = checked(path)
    state = read_state(path)
    init_optimizer_state(opt)
    saved_keys = set(state["keys"])
    want = {k for k in layout.keys}
    if saved_keys != want:
        raise CheckpointError(
            f"{path} holds another model: missing {sorted(want - saved_keys)[:8]}, "
            f"unexpected {sorted(saved_keys - want)[:8]}"
        )
    items = list(_items(layout, opt))
    sd: dict[str, Any] = {}
    for key, entry, live in items:
        sd[key] = _template(entry, live, layout)
    sd.update({f"model.{k}": torch.empty_like(b) for k, b in layout.buffers.items()})
    sd["optim.step"] = torch.tensor(0.0)
    sd["rng.cpu"] = torch.get_rng_state()
    check_shapes(path, metadata, sd, state)
    dcp.load(sd, storage_reader=integrity.SafeReader(str(path)))
    for key, entry, live in items:
        _assign(live, _block_of(sd[key], entry, layout), key)
    with torch.no_grad():
        for k, b in layout.buffers.items():
            b.copy_(sd[f"model.{k}"])
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p]["step"] = sd["optim.step"].clone()
    torch.set_rng_state(sd["rng.cpu"])
    log.info("loaded checkpoint %s (step %d)", path, state["step"])
    return state


# -- export ----------------------------------------------------------------------------------


def single_device_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's single-device ``state_dict`` from a checkpoint, in one process, no ranks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = resolve(path)
    meta = checked(path).state_dict_metadata
    state = read_state(path)
    sd: dict[str, torch.Tensor] = {}
    for key, md in meta.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            sd[key] = torch.empty(md.size, dtype=md.properties.dtype)
    absent = sorted(k for k in state["keys"]
                    if f"model.{state['aliases'].get(k, k)}" not in sd)  # fmt: skip
    if absent:
        raise CheckpointCorruptError(
            f"{path / integrity.METADATA}: has no tensor for {absent[:6]}, which "
            f"{STATE_FILE} lists under 'keys'"
        )
    with warnings.catch_warnings():  # "no process group: loading in one process" is the intent
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        dcp.load(sd, storage_reader=integrity.SafeReader(str(path)), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for key in state["keys"]:
        src = state["aliases"].get(key, key)
        t = sd[f"model.{src}"]
        out[key] = t.clone() if src != key else t.contiguous()  # no shared storage (safetensors)
    return out, state


def export(checkpoint: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the single-device state dict (original names) to ``out`` (.safetensors or .pt)."""
    sd, state = single_device_state_dict(checkpoint)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(out), metadata={"step": str(state["step"]), "model": json.dumps(
            {"preset": state.get("config", {}).get("model"),
             "overrides": state.get("config", {}).get("model_overrides", {})})})  # fmt: skip
    else:
        torch.save(sd, out)
    return {"path": str(out), "step": state["step"], "tensors": len(sd),
            "numel": sum(t.numel() for t in sd.values())}  # fmt: skip
