"""Started readers kept between loads, so that a long-lived process's next load reads through one.

Run:ai's object-storage client receives a load's bytes into part buffers it allocates as a reader
(one Run:ai streamer) first needs them and frees when the reader ends. A reader started for each
load faults every page of those buffers in again, in the threads that receive the bytes, and
waits for ``runai_end``. A reader kept started between loads receives the next load's bytes into
the buffers it has, with no new pages to fault in. A daemon keeps the one its
last load used, for at most ``idle_s`` seconds idle (``STREAMER_SEGMENT_IDLE_S``, the time it keeps
an idle segment) and not past :data:`MAX_AGE_S` from its start, and holds its buffers' memory
meanwhile.

A reader is kept only when it says it can serve another load (``reusable``: Run:ai's reader once
every range it was sent has answered and none failed fatally) and the load that used it ended
without an error; the reader of a load that failed or was cut short is closed with it. At most one
idle reader per kind (its class, filesystem strategy and storage environment).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from ..uri import StorageURI
from .base import Reader, ReaderFactory
from .choice import fs_strategy_for, open_reader

__all__ = ["MAX_AGE_S", "KeptReaders"]

log = logging.getLogger(__name__)

MAX_AGE_S = 600.0
"""A reader started longer ago than this is not used for another load: whatever Run:ai read once
at its start (the environment's settings and credentials) is read again now and then."""


class _Idle:
    __slots__ = ("key", "reader", "started", "since")

    def __init__(self, key: tuple, reader: Reader, started: float, since: float) -> None:
        self.key, self.reader, self.started, self.since = key, reader, started, since


class KeptReaders:
    """Started readers between loads: :meth:`reader` lends one (kept or new), :meth:`trim` closes
    those idle too long, :meth:`close` all of them. Thread-safe; a reader serves one load at a time."""

    def __init__(self, idle_s: float, *, max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.reused = 0  # loads that read through a kept reader
        self._clock = clock
        self._idle: list[_Idle] = []
        self._closed = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reader(
        self, uri: StorageURI, factory: ReaderFactory, environment: Mapping[str, str] | None = None
    ) -> Iterator[tuple[Reader, bool]]:
        """A started reader of ``uri`` (``open_reader``'s), and whether it was kept from an earlier
        load; after the load it is kept or closed (module docstring)."""
        key = (factory, fs_strategy_for(uri), tuple(sorted((environment or {}).items())))
        kept = self._take(key)
        if kept is not None:
            reader, started = kept
        else:
            reader, started = open_reader(uri, factory, environment), self._clock()
            reader.start()
        ended = False
        try:
            yield reader, kept is not None
            ended = True
        finally:
            if not (ended and self._keep(key, reader, started)):
                reader.close()

    def _take(self, key: tuple) -> tuple[Reader, float] | None:
        now = self._clock()
        with self._lock:
            for i, idle in enumerate(self._idle):
                if idle.key == key:
                    del self._idle[i]
                    break
            else:
                return None
            if not self._too_old(idle.started, now):
                self.reused += 1
                return idle.reader, idle.started
        _close(idle.reader)  # too old to serve another load
        return None

    def _keep(self, key: tuple, reader: Reader, started: float) -> bool:
        now = self._clock()
        if self.idle_s <= 0 or self._too_old(started, now) or not getattr(reader, "reusable", False):
            return False
        with self._lock:
            if self._closed or any(idle.key == key for idle in self._idle):
                return False
            self._idle.append(_Idle(key, reader, started, now))
            return True

    def _too_old(self, started: float, now: float) -> bool:
        """Whether a reader started at ``started`` may no longer serve a load (:data:`MAX_AGE_S`)."""
        return now - started >= self.max_age_s

    def trim(self, now: float) -> None:
        """Close the readers idle for ``idle_s`` or started ``max_age_s`` ago."""
        with self._lock:
            stale = [i for i in self._idle if now - i.since >= self.idle_s or self._too_old(i.started, now)]
            self._idle = [i for i in self._idle if i not in stale]
        for idle in stale:
            _close(idle.reader)

    def close(self) -> None:
        """Close every idle reader; none is kept from now on."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for entry in idle:
            _close(entry.reader)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


def _close(reader: Reader) -> None:
    try:
        reader.close()
    except Exception:  # noqa: BLE001 - closing an idle reader must not stop the daemon's reaper
        log.exception("closing an idle reader failed")
