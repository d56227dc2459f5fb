"""Command-line flags generated from a dataclass's fields: one source for names, defaults,
choices and help.

A field becomes ``--field-name`` when its metadata holds ``help`` (written with
:func:`flag`); its type comes from the annotation (``int | None`` parses as ``int``,
``list[str]`` takes one or more values), its default is read from the field and appended
to the help as ``(default: ...)``, never written by hand. A ``bool`` field defaulting to
False is a switch (``--name``); one defaulting to True is ``--name / --no-name``. Every
argparse default is ``argparse.SUPPRESS``, so a flag the user did not give stays out of the
namespace (a TOML file's value then stands: train/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any


def flag(
    default: Any,
    help: str,
    *,
    unset: str | None = None,
    choices: Iterable[str] | None = None,
    shown: str | None = None,
    **argparse_kw: Any,
) -> Any:
    """A dataclass field that is also a flag. ``unset``: what a None default means, in words
    (shown as the default); ``shown``: the default as the help shows it, when its repr is not
    what a user types; ``argparse_kw``: passed to ``add_argument`` (``type``, ``metavar``)."""
    meta = {"help": help, "unset": unset, "shown": shown, "argparse": argparse_kw}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return dataclasses.field(default=default, metadata=meta)


def default_text(f: dataclasses.Field[Any]) -> str:
    """The field's default as ``--help`` shows it."""
    meta = f.metadata
    if meta.get("shown") is not None:
        return meta["shown"]
    value = f.default
    if value is None:
        if not meta.get("unset"):
            raise TypeError(f"field {f.name!r}: a None default needs unset= (what None means)")
        return meta["unset"]
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _parser_type(hint: Any) -> tuple[Callable[[str], Any] | None, bool]:
    """(argparse ``type``, takes several values) for an annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return _parser_type(args[0])
    if typing.get_origin(hint) is list:
        return _parser_type(args[0])[0], True
    return (hint if hint in (int, float) else None), False


def add_dataclass_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of ``cls`` whose metadata holds ``help``, in field order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        name = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, **f.metadata["argparse"]}
        kw["help"] = f"{f.metadata['help']} (default: {default_text(f)})"
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        hint = hints[f.name]
        if hint is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        else:
            parse, several = _parser_type(hint)
            if parse is not None:
                kw.setdefault("type", parse)
            if several:
                kw["nargs"] = "+"
        p.add_argument(name, **kw)
