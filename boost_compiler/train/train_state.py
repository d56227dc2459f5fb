"""What a checkpoint records beside its tensors, checked before anything indexes into it.

``train_state.json`` holds the step, the state-dict key names and aliases, the optimizer
moments, the data position, the config and the layout; :func:`read_state` checks it
field by field, so a damaged or hand-edited file is a
:class:`~boost_compiler.errors.CheckpointCorruptError` naming the file and the field
(and the run falls back to an older checkpoint), never a raw ``TypeError`` or a step
``-2`` folder. :func:`check_shapes` compares what a load asks for with the checkpoint's
metadata, so a resume at another rank or width names the key and the flag at fault.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError, CheckpointMismatchError

STATE_FILE = "train_state.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
# A step count no run reaches: a larger one is a damaged file, not a long run.
MAX_STEP = 10**12


def read_state(path: str | Path) -> dict[str, Any]:
    """``path/train_state.json``, checked field by field (:class:`CheckpointCorruptError`
    naming the file and the field): what resume and export index into."""
    path = Path(path)
    file = path / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{file}: missing or not JSON ({type(exc).__name__}: {exc})"
        ) from exc
    _check_state(state, file, path)
    return state


def _check_state(state: Any, file: Path, folder: Path) -> None:
    def bad(name: str, want: str) -> CheckpointCorruptError:
        got = json.dumps(state.get(name))[:60] if name in state else "nothing"
        return CheckpointCorruptError(f"{file}: '{name}' must be {want}; got {got}")

    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{file}: must be a JSON object, not {type(state).__name__}")
    step = state.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise bad("step", f"an integer in [0, {MAX_STEP}]")
    m = STEP_DIR.match(folder.name)
    if m and int(m.group(1)) != step:
        raise bad("step", f"{m.group(1)}, the step of its folder {folder.name}")
    keys = state.get("keys")
    if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
        raise bad("keys", "a non-empty list of the model's state_dict key names")
    aliases = state.get("aliases")
    names = set(keys)
    if not isinstance(aliases, dict) or not all(
        isinstance(v, str) and v in names for v in aliases.values()
    ):
        raise bad("aliases", "an object of tied name -> one of 'keys'")
    moments = state.get("moments", [])
    if not isinstance(moments, list) or not all(isinstance(k, str) for k in moments):
        raise bad("moments", "a list of optimizer state names")
    for name in ("data", "config", "layout"):
        if name in state and not isinstance(state[name], dict):
            raise bad(name, "an object")
    if "tokens_seen" in state and type(state["tokens_seen"]) is not int:
        raise bad("tokens_seen", "an integer")


def check_shapes(path: Path, metadata: Any, sd: dict[str, Any], state: dict[str, Any]) -> None:
    """Every tensor ``dcp.load`` is asked for exists in the checkpoint with this shape (else
    :class:`CheckpointMismatchError` naming the key, both shapes and the likely flag), so a
    resume at another rank or width is not DCP's bare ``Size mismatch``."""
    saved = metadata.state_dict_metadata
    missing = sorted(k for k in sd if k not in saved)
    if missing:
        raise CheckpointMismatchError(
            f"{path}: has no {missing[:6]} (a model or optimizer other than this run's)"
        )
    for key, want in sd.items():
        have = getattr(saved[key], "size", None)
        if have is None or not torch.is_tensor(want) or tuple(have) == tuple(want.shape):
            continue
        cfg = state.get("config", {})
        was = ", ".join(f"--{k.replace('_', '-')} {cfg[k]}" for k in
                        ("model", "rank", "rank_ratio", "rank_multiple")
                        if cfg.get(k) is not None)  # fmt: skip
        overrides = cfg.get("model_overrides")
        was += f", model overrides {overrides}" if overrides else ""
        raise CheckpointMismatchError(
            f"{path}: '{key}' is {tuple(have)} in the checkpoint but {tuple(want.shape)} in "
            "this run's model: the low-rank rank (--rank / --rank-ratio / --rank-multiple, or "
            "a preset's [model] rank) or the model size (--model, [model] d_model, ...) "
            f"differs from the saved run's ({was or 'config not recorded'}); "
            "resume with the saved values, or start a new run without --resume"
        )
