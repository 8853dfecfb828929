"""The ring: reusable slots for a load's batches, plus at most one oversized buffer (docs/architecture.md).

One rule for both modes. The embedded engine fills private anonymous memory; the daemon fills
shared-memory segments. Either way a load holds at most ``capacity`` slots (made on first use,
then reused as batches are delivered, or retired and replaced by a new one where the delivered
tensors keep a slot's memory) and at most one oversized tensor's dedicated buffer at a time, so
the memory in flight stays within the budget plus one oversized tensor.

What a slot *is* stays with the caller: :meth:`Ring.take` gets a ``make`` callable, run outside
the ring's lock (making a segment zero-fills it), which may answer ``None`` when memory is not
available right now (the daemon's node-wide budget is held by other sessions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Ring"]

T = TypeVar("T")


class Ring(Generic[T]):
    """At most ``capacity`` reusable slots and one oversized buffer out at a time.

    ``lock`` guards the ring's counts when several threads use it (the daemon's session passes its
    condition); the engine's single-threaded stream leaves it out.
    """

    def __init__(self, capacity: int = 0, *, lock: contextlib.AbstractContextManager | None = None) -> None:
        self.capacity = capacity
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._slots: list[T] = []  # every slot made, in use or free
        self._free: list[T] = []
        self._making = 0  # slots being made right now (counted against the capacity)
        self._oversized_out = False

    def take(self, make: Callable[[], T | None], *, oversized: bool = False) -> T | None:
        """A slot: a free one, else a new one from ``make`` while the ring may grow. ``oversized``:
        a new buffer from ``make`` while no other oversized buffer is out. ``None``: wait for a
        release (or for ``make`` to find memory)."""
        with self._lock:
            if oversized:
                if self._oversized_out:
                    return None
                self._oversized_out = True
            else:
                if self._free:
                    return self._free.pop()
                if len(self._slots) + self._making >= self.capacity:
                    return None
                self._making += 1
        made = None
        try:
            made = make()
        finally:
            with self._lock:
                if oversized:
                    self._oversized_out = made is not None
                else:
                    self._making -= 1
                    if made is not None:
                        self._slots.append(made)
        return made

    def give(self, item: T, *, oversized: bool = False) -> None:
        """``item``'s batch was delivered: a slot is free for the next batch; an oversized buffer's
        place is free (the caller frees the buffer itself: it is never reused)."""
        with self._lock:
            if oversized:
                self._oversized_out = False
            else:
                self._free.append(item)

    def retire(self, item: T) -> None:
        """``item`` left the ring for good (its memory went to the caller with what was delivered
        from it, as the embedded engine's safe CPU tensors do): its place is free for a new slot."""
        with self._lock:
            self._slots.remove(item)

    def drain(self) -> list[T]:
        """Every slot made, in use or free; the ring holds nothing afterwards."""
        with self._lock:
            slots, self._slots, self._free = self._slots, [], []
            self._oversized_out = False
            return slots

    @property
    def room(self) -> int:
        """Slots the ring may still make (none while an oversized buffer's place is all it has)."""
        with self._lock:
            return max(self.capacity - len(self._slots) - self._making, 0)

    @property
    def made(self) -> int:
        with self._lock:
            return len(self._slots)

    def __repr__(self) -> str:
        return f"Ring(capacity={self.capacity}, made={len(self._slots)}, free={len(self._free)}, oversized_out={self._oversized_out})"
