"""The node's segments between loads: idle ones kept for reuse, and rings made ahead of need.

A :class:`SegmentPool` hands sessions the segments their rings take, within the daemon's
:class:`~.shm.ShmBudget`, and takes them back when a session ends. What it keeps idle, what it
makes in the background (at start, and when a ring grows) and what a retained load takes out of
it for good is in the class docstring; the segments themselves are :mod:`.shm`'s. The words
(idle segment, made ahead, standing ring, adopt, restand) are defined in docs/architecture.md,
"Segments".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from streamer_client.errors import ConfigError

from .shm import Reservation, Segment, SegmentStore, ShmBudget

__all__ = ["SegmentPool"]

log = logging.getLogger(__name__)


class SegmentPool:
    """Segments for every session of the daemon, within one :class:`ShmBudget`.

    A ring segment a session no longer needs stays mapped and idle for ``idle_s`` seconds, and
    the next session that needs one of its size takes it as it is (the one that went idle last
    first: :meth:`_take_idle`): its pages are already
    allocated, so the load skips the zero-fill and the first-touch
    faults (docs/architecture.md: "slots recycle"). Idle segments count against the budget; a request
    that does not fit evicts them first. ``idle_s = 0`` keeps nothing.

    Prepared segments (:meth:`start_preparing`, when the daemon starts): ring segments made ahead
    of the first load, in parallel and off any load's thread, so that the first load finds them
    as a later load finds the last one's. They wait for that first load however late it comes;
    from its first request on, they are idle segments like any other. A ring that grows past
    them asks for its next slots the same way (:meth:`make_ahead`), and takes them as they come
    (:meth:`take_made`; :meth:`watch` calls back each time one is made).

    The standing ring (``standing=True`` when preparing): as many idle segments of that size as
    were prepared are never trimmed, so a load that comes after a long idle spell starts on
    segments whose pages are allocated and mapped, as the first load did (new shared memory comes
    only as fast as the kernel zero-fills and maps it). With them stands the idle segment of
    another size that went idle last: the last load's oversized tensor's (an embedding, an
    ``lm_head``), which the next load of that checkpoint, or of any with a tensor of that size,
    would otherwise make on its loading thread before its first read. Only what a load grew past
    them goes after ``idle_s``; a request the budget cannot hold evicts them like any idle segment. A retained
    load adopts them for its first batches (:meth:`adopt`: its claim pays for them from then on)
    and the pool makes them again when its session ends (:meth:`restand`).
    """

    def __init__(self, store: SegmentStore, budget: ShmBudget, idle_s: float) -> None:
        self.store = store
        self.budget = budget
        self.idle_s = idle_s
        self.reused = 0
        self.prepared = 0  # segments made by start_preparing
        # (segment, reservation, idle since); since None: prepared, waiting for the first load
        self._idle: list[tuple[Segment, Reservation, float | None]] = []
        self._making = 0  # prepared segments on their way, of ``_making_size`` bytes
        self._making_size = 0
        self._closed = False
        self._making_stopped = False  # the daemon stops: nothing more is made ahead of need
        self._first_taken = False
        self._standing: tuple[int, int] = (0, 0)  # (segment bytes, count) never trimmed
        self._watchers: list[Callable[[], None]] = []  # called each time a segment was made ahead
        self._lock = threading.Condition()

    def start_preparing(self, nbytes: int, count: int, *, standing: bool = False) -> None:
        """Make up to ``count`` idle segments of ``nbytes`` in the background, within the budget
        (segments of one size at a time: a call for another size while some are on their way
        makes none). ``standing``: keep that many of them idle for good (see the class docstring)."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            if self._making_stopped or (self._making and self._making_size != nbytes):
                return
            if standing:
                self._standing = (nbytes, count)
            reservations = []
            while len(reservations) < count:
                reservation = self.budget.try_take(nbytes)
                if reservation is None:
                    break
                reservations.append(reservation)
            self._making += len(reservations)
            self._making_size = nbytes
        for i, reservation in enumerate(reservations):
            try:
                future = self.store.create_soon(nbytes)
            except BaseException:
                for unmade in reservations[i:]:
                    self._made(None, unmade)
                raise
            future.add_done_callback(functools.partial(self._made, reservation=reservation))

    @property
    def makes_ahead(self) -> bool:
        """Whether :meth:`make_ahead` makes anything: not while no idle segment may be kept (each
        is made when a load needs it), nor once the daemon stops."""
        with self._lock:
            return self.idle_s > 0 and not self._making_stopped

    def make_ahead(self, nbytes: int, wanted: int) -> None:
        """Segments of ``nbytes`` idle or on their way: at least ``wanted`` (a ring that grows has
        its next slots made off the load's thread, which meanwhile waits for a release or for them)."""
        if not self.makes_ahead:
            return
        nbytes = self.store.pages.round(nbytes)
        have = self.available(nbytes)
        if wanted > have:
            self.start_preparing(nbytes, wanted - have)

    def _made(self, future: Future[Segment] | None, reservation: Reservation) -> None:
        segment = None
        if future is not None:
            try:
                segment = future.result()
            except Exception as exc:  # noqa: BLE001 - a load that needs the room says it as a ConfigError
                log.warning("could not make a shared-memory segment ahead of need: %s", exc)
        with self._lock:
            self._making -= 1
            if segment is not None and not self._closed:
                self._idle.append((segment, reservation, time.monotonic() if self._first_taken else None))
                self.prepared += 1
                segment = reservation = None
            self._lock.notify_all()
            watchers = list(self._watchers)
        if segment is not None:
            segment.close()
        if reservation is not None:
            self.budget.give_back(reservation)
        for watcher in watchers:  # outside the lock: a watcher takes its session's
            watcher()

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on a maker thread, no lock held) each time a segment was made ahead."""
        with self._lock:
            self._watchers.append(callback)

    def unwatch(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._watchers.remove(callback)

    def take(self, nbytes: int, *, oversized: bool = False) -> tuple[Segment, Reservation] | None:
        """A segment of ``nbytes`` (in whole huge pages where the dir has them): an idle one, or a
        new one if the budget allows; else None. Waits for a prepared one of that size on its way."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            # An oversized batch takes an idle segment of its exact size too: a reload of the same
            # checkpoint skips the zero-fill and first touch of its largest tensors.
            got = self._take_idle(nbytes)
        if got is not None:
            return got
        reservation = self.budget.try_take(nbytes, oversized=oversized)
        if reservation is None and self._evict_idle():
            reservation = self.budget.try_take(nbytes, oversized=oversized)
        if reservation is None:
            return None
        try:
            try:
                return self.store.create(nbytes), reservation
            except ConfigError:  # a shm dir smaller than the budget: idle segments never stand in the way
                if not self._evict_idle():
                    raise
                return self.store.create(nbytes), reservation
        except BaseException:
            self.budget.give_back(reservation)
            raise

    def take_made(self, nbytes: int) -> tuple[Segment, Reservation] | None:
        """An idle segment of ``nbytes`` if there is one now: neither waits for one on its way nor
        makes one."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            return self._take_idle(nbytes, wait=False)

    def adopt(self, nbytes: int, count: int, *, wait: bool = True) -> list[Segment]:
        """Up to ``count`` idle segments of ``nbytes`` (``wait``: also those on their way, as they
        come), out of the pool for good: their bytes leave the budget, and whoever adopts them pays
        for them and closes them (a retained load's claim). :meth:`restand` makes the standing ring
        whole again."""
        nbytes = self.store.pages.round(nbytes)
        adopted = []
        with self._lock:
            while len(adopted) < count and (got := self._take_idle(nbytes, wait=wait)) is not None:
                adopted.append(got)
        for _, reservation in adopted:
            self.budget.give_back(reservation)
        return [segment for segment, _ in adopted]

    def available(self, nbytes: int) -> int:
        """Idle segments of ``nbytes``, and those on their way."""
        nbytes = self.store.pages.round(nbytes)
        with self._lock:
            return sum(s.nbytes == nbytes for s, _, _ in self._idle) + (self._making if self._making_size == nbytes else 0)

    def restore(self, segments: list[Segment]) -> None:
        """Adopted segments that were never written come back idle, where the budget still has
        room for them (else they are unlinked)."""
        now = time.monotonic()
        for segment in segments:
            reservation = self.budget.try_take(segment.nbytes)
            if reservation is None:
                segment.close()
            else:
                self.give(segment, reservation, keep=True, now=now)

    def restand(self) -> None:
        """Make the standing ring whole again in the background, where segments of it were adopted."""
        size, count = self._standing
        if count:
            self.make_ahead(size, count)

    def _take_idle(self, nbytes: int, *, wait: bool = True) -> tuple[Segment, Reservation] | None:
        """An idle segment of exactly ``nbytes``, the one that went idle last, waiting for one on
        its way (``wait``); ``None`` if there is none. Called under the lock. The last load's
        segments first: a process that loads again has them mapped (and page-locked) already, and
        those no load needs any more are left to age out (:meth:`trim`)."""
        # The first load has started: prepared segments it leaves are idle like any other from now.
        self._first_taken = True
        self._idle = [(s, r, time.monotonic() if since is None else since) for s, r, since in self._idle]
        while True:
            for i in range(len(self._idle) - 1, -1, -1):
                segment, reservation, _ = self._idle[i]
                if segment.nbytes == nbytes:
                    del self._idle[i]
                    self.reused += 1
                    return segment, reservation
            if not (wait and self._making and self._making_size == nbytes):
                return None
            self._lock.wait()  # it holds budget this request would otherwise not find

    def give(self, segment: Segment, reservation: Reservation, *, keep: bool, now: float) -> None:
        """Return a segment no session uses; ``keep`` it idle for reuse, or unlink it now."""
        with self._lock:
            if keep and self.idle_s > 0 and not reservation.beyond_budget and not self._closed:
                self._idle.append((segment, reservation, now))
                return
        segment.close()
        self.budget.give_back(reservation)

    def trim(self, now: float) -> None:
        """Unlink segments idle for longer than ``idle_s`` (prepared ones wait for the first load),
        but for the standing ones: the standing ring's, and the segment of another size that went
        idle last (see the class docstring)."""
        with self._lock:
            size, count = self._standing
            fresh = [e for e in self._idle if e[2] is None or now - e[2] < self.idle_s]
            stale = [e for e in self._idle if e[2] is not None and now - e[2] >= self.idle_s]
            stand = max(0, count - sum(e[0].nbytes == size for e in fresh))
            kept = [e for e in stale if e[0].nbytes == size][:stand]
            others = [e for e in stale if e[0].nbytes != size]
            # Where a fresh one of another size went idle later, that one stands once it is stale.
            if count and others and not any(e[0].nbytes != size for e in fresh):
                kept.append(max(others, key=lambda e: e[2]))
            gone = [e for e in stale if not any(e is k for k in kept)]
            self._idle = fresh + kept
        self._close(gone)

    def stop_making(self) -> None:
        """Make nothing more ahead of need (the daemon stops); what is on its way still comes."""
        with self._lock:
            self._making_stopped = True

    def close(self) -> None:
        with self._lock:
            self._closed = self._making_stopped = True
            while self._making:  # every segment on its way is closed as it comes
                self._lock.wait()
            idle, self._idle = self._idle, []
        self._close(idle)

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @property
    def preparing(self) -> bool:
        with self._lock:
            return self._making > 0

    def _evict_idle(self) -> bool:
        with self._lock:
            idle, self._idle = self._idle, []
        self._close(idle)
        return bool(idle)

    def _close(self, entries: list[tuple[Segment, Reservation, float | None]]) -> None:
        for segment, reservation, _ in entries:
            segment.close()
            self.budget.give_back(reservation)
