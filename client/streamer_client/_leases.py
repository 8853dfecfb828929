"""Borrowed views: noticing a caller who keeps one past its lifetime.

A ``borrowed=True`` tensor is a view of a reusable buffer (an in-process ring slot, or a daemon's
shared-memory segment), valid until the caller asks for the next item. Before its buffer is
reused, every view lent from it must be gone; otherwise :class:`BorrowedTensorError` is raised
instead of letting the memory change under the caller. One blind spot: the item yielded last is
still held by the caller's loop variable, so it cannot be told apart from a kept one.
"""

from __future__ import annotations

import weakref

from .errors import BorrowedTensorError

__all__ = ["Leases"]


class Leases:
    """The views lent from one buffer since it was last filled."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: list[tuple[str, weakref.ref]] = []

    def lend(self, name: str, view) -> weakref.ref:
        """Record ``view`` (a numpy array the tensor is built on); returns its weak reference."""
        ref = weakref.ref(view)
        self._refs.append((name, ref))
        return ref

    def end(self, in_hand: weakref.ref | None) -> None:
        """The buffer is about to be reused: raise if a lent view other than ``in_hand`` lives."""
        kept = [name for name, ref in self._refs if ref is not in_hand and ref() is not None]
        if kept:
            raise BorrowedTensorError(
                f"{len(kept)} borrowed tensor(s) are still referenced when their buffer is about to be "
                f"reused (first: {kept[0]!r}); a borrowed=True tensor is valid only until the next item "
                "is requested: .clone() what you keep, or stream without borrowed=True",
                key=kept[0],
            )
        self._refs.clear()
