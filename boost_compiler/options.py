"""Backend options: what ``torch.compile(..., options={...})`` may contain.

Every pass of :data:`boost_compiler.passes.PIPELINE` is an option under its
own name (``True``/``False``, or one of the pass's ``allowed`` values). A few
settings are not passes; they are listed in :data:`SETTINGS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import OptionTypeError, UnknownOptionError
from .passes.order import PIPELINE


@dataclass(frozen=True)
class Setting:
    types: tuple[type, ...]
    default: Any
    doc: str
    choices: tuple[Any, ...] = ()


SETTINGS: dict[str, Setting] = {
    "lowering": Setting(
        (str,), "inductor", "how the rewritten graph runs", choices=("inductor", "eager")
    ),
    "inductor_config": Setting((dict,), None, "extra Inductor config patches passed to compile_fx"),
    "compile_in_turns": Setting(
        (bool,),
        lambda: os.environ.get("BOOST_COMPILE_IN_TURNS", "0") == "1",
        "parallelized models: ranks compile one after another, reusing each other's kernels "
        "from a shared Inductor cache (for ranks sharing CPU cores; $BOOST_COMPILE_IN_TURNS=1)",
    ),
    "collective_wait": Setting(
        (str,),
        "auto",
        "how a rank waits for a collective in compiled graphs: 'poll' (yielding the core "
        "between checks: a sleeping core's wake-up costs more than a small transfer), "
        "'block' (torch's wait_tensor), 'auto' (poll on gloo groups)",
        choices=("auto", "poll", "block"),
    ),
    "overlap_comm": Setting(
        (bool, str),
        "auto",
        "compiled graphs start each collective as early and wait for it as late as their "
        "order allows, so independent work runs while it is in flight "
        "(boost_compiler/lowering/overlap.py); 'auto': where the waits poll (gloo groups), "
        "the only place it was measured: 0.99-1.03x at V=256, 0.98-1.06x at V=32,000",
        choices=(True, False, "auto"),
    ),
    "symm_mem_all_reduce": Setting(
        (int,),
        0,
        "parallelized models on CUDA/NCCL: all-reduces of at most this many bytes run as "
        "symmetric-memory one-shot all-reduces, lowered by Inductor's own rule "
        "(boost_compiler/lowering/symm_mem.py); 0, the default: NCCL all-reduces",
    ),
    "compile_blocks": Setting(
        (bool,),
        True,
        "parallelize: the model's repeated blocks (children of one class in a ModuleList) "
        "become nested compile regions, so a compiled model plans, rewrites and lowers each "
        "distinct block once and reuses it (False: the whole model as one graph)",
    ),
    "dump_dir": Setting(
        (str,),
        None,
        "write each pass's graph (code, DOT/SVG drawings) here (also: $BOOST_DUMP_DIR)",
    ),
}


@dataclass(frozen=True)
class BoostOptions:
    """Validated options: per-pass settings plus the non-pass settings."""

    passes: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def enabled(self, name: str) -> bool:
        return self.passes.get(name, False) is not False

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> BoostOptions:
        """Check names and types; unknown names and wrong types raise naming the option."""
        options = dict(options or {})
        passes = {p.name: p for p in PIPELINE}
        valid = sorted([*passes, *SETTINGS])
        for name in options:
            if name not in passes and name not in SETTINGS:
                raise UnknownOptionError(
                    f"unknown boost option {name!r}; valid options are: {', '.join(valid)}"
                )
        chosen: dict[str, Any] = {}
        for name, p in passes.items():
            value = options.get(name, p.default)
            if not (isinstance(value, bool) or value in p.allowed):
                accepted = " or ".join(["True/False", *map(repr, p.allowed)])
                raise OptionTypeError(
                    f"boost option {name!r} must be {accepted}, got {value!r} "
                    f"({type(value).__name__})"
                )
            chosen[name] = value
        settings: dict[str, Any] = {}
        for name, s in SETTINGS.items():
            value = options.get(name, s.default() if callable(s.default) else s.default)
            if value is not None and not isinstance(value, s.types):
                raise OptionTypeError(
                    f"boost option {name!r} ({s.doc}) must be "
                    f"{' or '.join(t.__name__ for t in s.types)}, got {type(value).__name__}"
                )
            if s.choices and value not in s.choices:
                raise OptionTypeError(
                    f"boost option {name!r} must be one of {s.choices}, got {value!r}"
                )
            settings[name] = value
        return cls(chosen, settings)
