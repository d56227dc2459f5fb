"""Passes over Inductor's post-grad graphs (forward and backward), after the boost pipeline.

The boost passes rewrite dynamo's forward graph; AOTAutograd then derives the backward,
and only at Inductor's post-grad stage do both graphs exist with their collectives. What
must see those (how a rank waits for a collective) lives here.
"""

import hashlib
from pathlib import Path

from .poll_waits import POLLED, poll_waits, polls

# folded into Inductor's cache key: a change to these passes recompiles
SOURCE_DIGEST = hashlib.sha256(
    b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))
).hexdigest()[:16]

__all__ = ["POLLED", "SOURCE_DIGEST", "poll_waits", "polls"]
