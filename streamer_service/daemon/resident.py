"""Checkpoint bytes kept in shared memory after their load, for the next load of the same version.

With a retention budget (``STREAMER_RETENTION_BUDGET``, off by default) a session whose missing
bytes fit (a retained load) streams each batch into a kept segment of its own instead of a
recycled ring slot, and registers the batch's tensors here once loaded. The segments outlive the
session, so:

- a rank that restarts, or a whole new launch of the same checkpoint, is served from node memory
  with no storage read (docs/architecture.md: "every byte once per node");
- a rank that rejoins while its session is still streaming gets every batch already loaded.

A resident copy belongs to one *generation* of a checkpoint: the metadata pull its catalog was
built from (a forced re-pull makes a new one) plus the objects' sizes and ETags. A session of
another generation drops it; so does a changed object found when a session validates the copy
against a fresh listing before serving it. Copies are evicted least recently used first, never
while a session uses them (``pin``/``unpin``).

The store owns the bytes it accounts: ``claim`` reserves room for a session's batches, ``add``
turns a loaded segment into resident tensors, ``settle`` returns what the session did not use.
The words are defined in docs/architecture.md, "Segments".
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from .shm import Segment
from .stats import ResidentStats

__all__ = ["ResidentCopy", "ResidentStore", "ResidentTensor"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResidentTensor:
    segment: Segment
    offset: int


@dataclass(eq=False)
class ResidentCopy:
    """The resident tensors of one checkpoint generation."""

    uri: str
    generation: str
    tensors: dict[str, ResidentTensor] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    nbytes: int = 0  # segment bytes owned
    pins: int = 0  # sessions serving from it or adding to it
    dropped: bool = False  # out of the store; its segments go when the last pin does

    def get(self, name: str) -> ResidentTensor | None:
        return self.tensors.get(name)


class ResidentStore:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0  # resident segment bytes plus claims of sessions streaming into new ones
        self.hits_bytes = 0  # bytes served from memory
        self.evictions = 0
        self._copies: OrderedDict[str, ResidentCopy] = OrderedDict()  # by URI, least recent first
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    # ------------------------------------------------------------------ sessions

    def pin(self, uri: str, generation: str) -> ResidentCopy:
        """The copy of ``uri`` at ``generation`` (new and empty if none), pinned for a session.

        A copy of another generation is dropped: its checkpoint was re-pulled or changed.
        """
        with self._lock:
            copy = self._copies.get(uri)
            if copy is not None and copy.generation != generation:
                log.info("dropping the resident copy of %s: its metadata was pulled again", uri)
                self._drop_locked(copy)
                copy = None
            if copy is None:
                copy = ResidentCopy(uri, generation)
                self._copies[uri] = copy
            self._copies.move_to_end(uri)
            copy.pins += 1
            return copy

    def holds(self, uri: str, generation: str, names: Iterable[str]) -> bool:
        """Whether the copy of ``uri`` at ``generation`` holds every tensor of ``names`` now (read only
        where there is such a copy). A hint, nothing pinned: a session serves from memory only once
        it has pinned the copy and found its objects unchanged."""
        with self._lock:
            copy = self._copies.get(uri)
            return (
                copy is not None and copy.generation == generation and not copy.dropped and all(n in copy.tensors for n in names)
            )

    def unpin(self, copy: ResidentCopy) -> None:
        with self._lock:
            copy.pins -= 1
            if self._copies.get(copy.uri) is copy and not copy.tensors and not copy.pins:
                del self._copies[copy.uri]  # nothing kept: no entry
                copy.dropped = True
            if copy.dropped and not copy.pins:
                self._release_locked(copy)

    def drop(self, copy: ResidentCopy, why: str) -> None:
        """Forget ``copy`` (a changed object, a failed load): its segments go once unpinned."""
        with self._lock:
            if not copy.dropped:
                log.warning("dropping the resident copy of %s: %s", copy.uri, why)
                self._drop_locked(copy)

    def claim(self, copy: ResidentCopy, nbytes: int, *, extra: int = 0) -> int:
        """Reserve ``nbytes`` for segments ``copy`` will own, evicting unpinned copies (least
        recently used first) as needed, and none where that would not make room; and ``extra``
        bytes more where they fit without evicting more. The bytes reserved, 0 when none."""
        with self._lock:
            if copy.dropped or nbytes > self.limit:
                return 0
            victims = [c for c in self._copies.values() if not c.pins]
            if self.used - sum(v.nbytes for v in victims) + nbytes > self.limit:
                return 0
            for victim in victims:
                if self.used + nbytes <= self.limit:
                    break
                log.info("evicting the resident copy of %s (%d bytes) for %s", victim.uri, victim.nbytes, copy.uri)
                self.evictions += 1
                self._drop_locked(victim)
            claimed = nbytes + (extra if self.used + nbytes + extra <= self.limit else 0)
            self.used += claimed
            return claimed

    def add(self, copy: ResidentCopy, segment: Segment, tensors: Iterable[tuple[str, int]]) -> None:
        """``segment`` (claimed by ``copy``'s session) now holds loaded ``(name, offset)`` tensors."""
        with self._lock:
            copy.segments.append(segment)
            copy.nbytes += segment.nbytes
            for name, offset in tensors:
                copy.tensors[name] = ResidentTensor(segment, offset)

    def settle(self, unused: int) -> None:
        """Give back the part of a claim that no segment took (the session ended)."""
        with self._lock:
            self.used -= unused

    def served(self, nbytes: int) -> None:
        with self._lock:
            self.hits_bytes += nbytes

    def close(self) -> None:
        with self._lock:
            for copy in list(self._copies.values()):
                self._drop_locked(copy)
                if copy.pins:  # the daemon is stopping: its sessions are gone
                    self._release_locked(copy)

    # ------------------------------------------------------------------ reporting

    def stats(self) -> ResidentStats:
        with self._lock:
            return ResidentStats(
                retention_budget=self.limit,
                resident_bytes=sum(c.nbytes for c in self._copies.values()),
                resident_checkpoints=tuple(
                    {"uri": c.uri, "bytes": c.nbytes, "tensors": len(c.tensors), "pins": c.pins}
                    for c in reversed(self._copies.values())
                ),
                resident_bytes_served=self.hits_bytes,
                resident_evictions=self.evictions,
            )

    # ------------------------------------------------------------------ internals

    def _drop_locked(self, copy: ResidentCopy) -> None:
        if self._copies.get(copy.uri) is copy:
            del self._copies[copy.uri]
        copy.dropped = True
        if not copy.pins:
            self._release_locked(copy)

    def _release_locked(self, copy: ResidentCopy) -> None:
        segments, copy.segments, copy.tensors = copy.segments, [], {}
        for segment in segments:
            segment.close()  # ranks that still map it keep their pages until they unmap
        self.used -= copy.nbytes
        copy.nbytes = 0
