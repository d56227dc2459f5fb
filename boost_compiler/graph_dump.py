"""Dump each pass's graph while ``torch.compile(..., backend="boost")`` runs.

Set ``BOOST_DUMP_DIR=/some/dir`` (or the backend option ``dump_dir``) and every
compiled graph gets a folder ``<dir>/graph_<n>/`` with ``00_input.py``, then
one ``<i>_<pass>.py`` per pass that ran: the readable code of the graph after
that pass, so ``diff`` shows exactly what a pass changed on your model.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch.fx as fx

from ._logging import get_logger

log = get_logger(__name__)
ENV_VAR = "BOOST_DUMP_DIR"
_graph_ids = itertools.count()


class GraphDumper:
    """Writes the stages of one graph; a no-op when no directory is configured."""

    def __init__(self, out_dir: str | None = None) -> None:
        root = out_dir or os.environ.get(ENV_VAR)
        self.dir = Path(root) / f"graph_{next(_graph_ids)}" if root else None
        self.step = 0

    def __call__(self, stage: str, gm: fx.GraphModule) -> None:
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        gm.recompile()
        path = self.dir / f"{self.step:02d}_{stage}.py"
        path.write_text(gm.print_readable(print_output=False))
        self.step += 1
        log.debug("boost: wrote %s", path)
