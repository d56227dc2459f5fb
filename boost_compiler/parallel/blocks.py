"""A model's repeated blocks, made nested compile regions (option ``compile_blocks``).

A decoder's layers are children of one class in a ``ModuleList``; as nested compile
regions (``torch.compiler.nested_compile_region``) dynamo traces one of them and
reuses the trace, and AOTAutograd and Inductor compile each distinct body once, so the
time to a first compiled step stops growing with depth (torchtitan compiles per block
for the same reason). The mark is a subclass whose ``forward`` is the region: given to
an instance's ``__class__``, it leaves the user's class, and every other instance of it,
as they are. Invariant: a marked module computes what it computed before (the region is
a no-op outside ``torch.compile``, and a compiled body is planned for the placements of
each call: ``tp/regions.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn

_MARK = "__boost_region__"


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the modules in ``ModuleList``s of two or more children of one class whose
    parameters and buffers agree (names, shapes, dtypes).

    Only the outermost such lists: a list inside a block (experts) stays in its block.
    Children of one class that hold different tensors (a bias in one, ``None`` in the
    next) are not blocks: dynamo's check whether a later call may reuse the first call's
    trace read a tensor attribute of a call where it was ``None`` and raised, on some
    ranks and not others (torch 2.13; found by the fuzzer as a hang).
    """
    found: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or any(name.startswith(f + ".") for f in found):
            continue
        children = list(mod.named_children())
        kinds = {(type(c), _tensors(c)) for _, c in children}
        if len(children) >= 2 and len(kinds) == 1 and any(True for _ in mod.parameters()):
            found += [f"{name}.{n}" if name else n for n, _ in children]
    return found


def _tensors(block: nn.Module) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    named = [*block.named_parameters(), *block.named_buffers()]
    return tuple((n, tuple(t.shape), t.dtype) for n, t in named)


@functools.cache
def region_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its forward a nested compile region (one subclass per class)."""
    if getattr(cls, _MARK, False):
        return cls
    body = {
        "forward": torch.compiler.nested_compile_region(cls.forward),
        _MARK: True,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    return type(cls.__name__, (cls,), body)


def mark(model: nn.Module, names: Sequence[str]) -> None:
    """Make the named modules of ``model`` nested compile regions, for good."""
    for name in names:
        mod = model.get_submodule(name)
        mod.__class__ = region_class(type(mod))


@contextlib.contextmanager
def marked(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """The named modules of ``model`` as regions for the duration (their classes restored)."""
    mods = [model.get_submodule(n) for n in names]
    before = [type(m) for m in mods]
    try:
        mark(model, names)
        yield
    finally:
        for m, cls in zip(mods, before, strict=True):
            m.__class__ = cls
