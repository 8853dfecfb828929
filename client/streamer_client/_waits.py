"""Waits in native code, cut into slices: the interpreter runs between two slices (so that Ctrl-C
is handled), and a wait with a deadline ends there. Used by the copier's waits and by the daemon's
and the embedded engine's wait for Run:ai's answers."""

from __future__ import annotations

import math
import time

__all__ = ["POLL_MS", "slice_ms"]

POLL_MS = 500
"""The longest slice: a native wait returns to the interpreter at least this often."""


def slice_ms(deadline: float | None) -> int:
    """The next slice of a wait that ends at ``deadline`` (``time.monotonic()``; ``None``: never):
    :data:`POLL_MS`, or what is left of the wait, at least 1 ms (a native wait of 0 ms waits
    without a limit in Run:ai, and not at all in the copier)."""
    if deadline is None:
        return POLL_MS
    return max(1, min(POLL_MS, math.ceil((deadline - time.monotonic()) * 1000)))
