"""The ``boost_compiler`` logger; everything logs through it (never print)."""

from __future__ import annotations

import logging

log = logging.getLogger("boost_compiler")


def get_logger(name: str) -> logging.Logger:
    """A child of the package logger, e.g. ``boost_compiler.detect``."""
    return log.getChild(name.rsplit(".", 1)[-1])
