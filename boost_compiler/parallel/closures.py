"""Functions stored on a model's modules, rebound to the shadow's modules.

``copy.deepcopy`` copies a plain function by reference, so a lambda or closure kept on a
module (``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))``, as in some public GPT
code) would still call the *model's* modules from the shadow: after ``parallelize`` those
hold this rank's shards, and dynamo would trace the local shapes as if they were global.
:func:`plan_rebinding` finds every such function before anything is modified and refuses,
with :class:`~boost_compiler.errors.ClosureError` naming the attribute, what it cannot
rebind (a module reached through a global name or a container in a cell); :func:`rebind`
then gives the shadow a copy of each function whose cells, defaults and ``partial``
arguments name the shadow's modules and placeholders.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ClosureError


@dataclass(frozen=True)
class Rebinding:
    """A function-valued attribute ``attr`` of module ``module`` (a name in the model)."""

    module: str
    attr: str


def _model_objects(model: nn.Module) -> dict[int, str]:
    """id -> name of every module, parameter and buffer of the model."""
    named: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        named.setdefault(id(mod), name or "<the model>")
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        named.setdefault(id(t), name)
    return named


def _function_of(value: Any) -> types.FunctionType | None:
    if isinstance(value, functools.partial):
        return _function_of(value.func)
    return value if isinstance(value, types.FunctionType) else None


def _cell_values(fn: types.FunctionType) -> list[Any]:
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell (a name assigned later)
            continue
    return values


def _reaches(value: Any, named: Mapping[int, str], depth: int = 0) -> str | None:
    """The name of a model object inside a container ``value``, if any (a few levels)."""
    if id(value) in named:
        return named[id(value)]
    if depth > 3 or not isinstance(value, (list, tuple, dict, set, frozenset)):
        return None
    items = value.values() if isinstance(value, dict) else value
    return next((n for v in items if (n := _reaches(v, named, depth + 1)) is not None), None)


def _check_function(fn: types.FunctionType, named: Mapping[int, str], where: str) -> bool:
    """Whether ``fn`` names model objects that can be rebound; raise where they cannot."""
    found = False
    for value in (*_cell_values(fn), *(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
        inner = _function_of(value)
        if inner is not None:
            found |= _check_function(inner, named, where)
        elif id(value) in named:
            found = True
        elif (reached := _reaches(value, named)) is not None:
            raise ClosureError(
                f"{where} is a function whose closure holds {reached!r} of the model inside a "
                f"{type(value).__name__}; the parallelized model's shadow cannot rebind it. "
                "Make it a method (def ... (self, x)) or an nn.Module"
            )
    for name in fn.__code__.co_names:
        value = fn.__globals__.get(name)
        if isinstance(value, (nn.Module, torch.Tensor)) and id(value) in named:
            raise ClosureError(
                f"{where} is a function that reaches {named[id(value)]!r} of the model through "
                f"the global name {name!r}; the parallelized model's shadow cannot rebind it. "
                "Make it a method (def ... (self, x)) or pass the module as an argument"
            )
    return found


def plan_rebinding(model: nn.Module) -> list[Rebinding]:
    """The function attributes of ``model``'s modules that name its modules or tensors.

    Raises :class:`ClosureError` for one that reaches them in a way :func:`rebind`
    cannot follow. Runs before ``parallelize`` modifies anything.
    """
    named = _model_objects(model)
    out = []
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            fn = _function_of(value)
            where = f"attribute {attr!r} of module {mod_name or '<the model>'!r}"
            if fn is not None and _check_function(fn, named, where):
                out.append(Rebinding(mod_name, attr))
    return out


def rebind(shadow: nn.Module, rebindings: Iterable[Rebinding], memo: Mapping[int, Any]) -> None:
    """Replace each planned function on ``shadow`` by one naming ``memo``'s copies."""
    modules = dict(shadow.named_modules())
    for r in rebindings:
        smod = modules[r.module]
        smod.__dict__[r.attr] = _rebound(smod.__dict__[r.attr], memo)


def _rebound(value: Any, memo: Mapping[int, Any]) -> Any:
    if isinstance(value, functools.partial):
        return functools.partial(
            _rebound(value.func, memo),
            *(_rebound(a, memo) for a in value.args),
            **{k: _rebound(v, memo) for k, v in value.keywords.items()},
        )
    if isinstance(value, types.FunctionType):
        cells = tuple(_rebound_cell(c, memo) for c in value.__closure__ or ())
        fn = types.FunctionType(
            value.__code__, value.__globals__, value.__name__,
            tuple(_rebound(d, memo) for d in value.__defaults__ or ()) or None,
            cells or None,
        )  # fmt: skip
        if value.__kwdefaults__:
            fn.__kwdefaults__ = {k: _rebound(v, memo) for k, v in value.__kwdefaults__.items()}
        fn.__dict__.update(value.__dict__)
        fn.__qualname__ = value.__qualname__
        return fn
    return memo.get(id(value), value)


def _rebound_cell(cell: types.CellType, memo: Mapping[int, Any]) -> types.CellType:
    """A new cell only where its value changes: other cells stay shared with their scope."""
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return cell
    new = _rebound(value, memo)
    return cell if new is value else types.CellType(new)
