"""Which deliveries may belong to an evaluation another worker holds.

A worker whose evaluation slots are all taken looks up the lease of a delivery before it
waits for a slot, and passes on at once a message another worker holds (a retry held
until a slot frees would start late). Only the first delivery of a submission can skip
that look: nobody can have begun its evaluation yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.core.messages import SUBMIT_REASON


def may_be_held_elsewhere(kind: str, body: Mapping[str, Any], redelivered: bool) -> bool:
    """False only for the first delivery of a submitted `execute`."""
    return not (kind == "execute" and body.get("reason") == SUBMIT_REASON and not redelivered)
