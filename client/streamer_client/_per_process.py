"""Process-wide objects made on first use and forgotten in a forked child.

The process's copier pool, its file mappings and its page-locked slots each own threads, timers
or locks of the process that made them. A child made with ``fork`` has none of the parent's
threads, and a lock the parent held at the fork stays held in the child, so the child must make
its own object on first use instead of using the parent's: :class:`PerProcess` does that once
for every such object (``os.register_at_fork``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerProcess"]

T = TypeVar("T")

_ALL: weakref.WeakSet[PerProcess] = weakref.WeakSet()


class PerProcess(Generic[T]):
    """The one ``make()`` of this process, made on first :meth:`get`; a forked child makes its own."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: T | None = None
        _ALL.add(self)

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._make()
            return self._value

    def peek(self) -> T | None:
        """The object if this process made it already, else None (makes nothing)."""
        return self._value

    def _forget(self) -> None:
        self._value = None
        self._lock = threading.Lock()


def _forget_all_after_fork() -> None:
    for instance in list(_ALL):
        instance._forget()


os.register_at_fork(after_in_child=_forget_all_after_fork)
