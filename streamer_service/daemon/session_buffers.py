"""Where a daemon session's batches land: ring segments from the node's pool, or segments that stay.

A session streams each batch into a shared-memory segment and hands the ranks handles into it.
This module owns those segments for one session; the session owns who may read them (``ledger``)
and when (its state machine). Two kinds of segment:

- **Ring slots** (the default): segments of the daemon's slot size, as many as the budget holds
  (``sizing.ring_slots``, the rule shared with the embedded engine; made only when no free one is
  left) plus one oversized tensor's (``ring``), paid
  from the node's shm budget (``segment_pool.SegmentPool``) and given back to the pool when the session
  ends, where the next session of any checkpoint can reuse them. Once the ring grows past the
  pool's idle segments, its next ``RING_AHEAD`` are made on the store's maker threads, and the
  load's thread makes none itself while a release may come: it takes whichever comes first, a
  slot the ranks released or a segment made (where the ranks are slower than the reads, growing
  the ring on the load's thread only delays the reads behind it).
- **Kept segments** (a retained load: a retention budget with room for it): one segment per
  batch, paid by a claim on the resident store; once loaded, the resident copy owns it and serves later loads
  from it (``resident``). The first slot batches take the pool's idle segments of the slot size
  (the standing ring, made already: ``SegmentPool.adopt``; those made are taken out of the pool
  as the load is planned, those still on their way as their batch is due), which the pool makes
  again once the session ends; the other batches get segments of their exact size, made ahead of need, up to
  ``KEPT_AHEAD`` at a time on the store's maker threads, while Run:ai reads into the ones before
  (the claim already pays for every one of them, so making them early takes nothing more). New
  shared memory comes only as fast as the kernel zero-fills it, slower than object storage on
  some hosts: the segments made already let the load start at once and give the makers a head
  start.

When the session ends (:meth:`SessionBuffers.release`), every segment goes back but those a rank
still holds (the ledger's lifetime rule): each of those goes back when its last holder lets go
(:meth:`~SessionBuffers.recycle`), and the resident copy stays pinned until none is held
(:meth:`~SessionBuffers.unheld`).

The words (ring slot, oversized segment, kept segment, standing ring, adopt, claim and settle,
ring bound) are defined in docs/architecture.md, "Segments".

Locking: ``lock`` is the session's condition; every method that changes the segment list takes
it. :meth:`acquire` takes or makes a new segment outside it (``Ring.take``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from streamer_client._protocol import Handle

from ..checkpoint.catalog import TensorInfo
from ..checkpoint.plan import Batch, BatchKind, Placement, Plan
from ..load.ring import Ring
from ..sizing import first_ring_slots, ring_slots
from .resident import ResidentCopy, ResidentStore
from .segment_pool import SegmentPool
from .shm import CREATE_WORKERS, Reservation, Segment

__all__ = ["KEPT_AHEAD", "SegmentSlot", "SessionBuffers", "handle"]

log = logging.getLogger(__name__)

# Ring slots made ahead once the ring grows past the segments the pool has idle: the next growth
# takes a made one instead of zero-filling a segment on the load's thread.
RING_AHEAD = 2

# Kept segments being made or ready ahead of the batch that needs them: one per maker thread, and
# as many again ready, so the makers never wait for the pipeline to ask.
KEPT_AHEAD = 2 * CREATE_WORKERS


def handle(batch: int, segment: Segment | None, offset: int, tensor: TensorInfo, dedicated: bool = False) -> Handle:
    """A rank's handle to ``tensor`` at ``offset`` in ``segment`` (``None``: an empty tensor), of
    the segment's generation now; ``dedicated``: an oversized tensor's own segment, unlinked once released."""
    if segment is None:
        return Handle(batch, None, offset, tensor.nbytes, tensor.name, tensor.dtype, tensor.shape, dedicated)
    return Handle(
        batch, segment.name, offset, tensor.nbytes, tensor.name, tensor.dtype, tensor.shape, dedicated,
        segment.entry, segment.generation,
    )  # fmt: skip


@dataclass(eq=False)
class SegmentSlot:
    """One segment a batch is streamed into, and who pays for it."""

    segment: Segment
    reservation: Reservation | None  # None: the session's resident claim pays for it
    oversized: bool
    resident: bool = False  # loaded and handed to the resident copy, which owns it from then on

    @property
    def kept(self) -> bool:
        return self.reservation is None


class SessionBuffers:
    def __init__(
        self,
        pool: SegmentPool,
        slot_size: int,
        resident: ResidentStore | None,
        *,
        lock: threading.Condition,
        clock: Callable[[], float],
    ) -> None:
        self._pool = pool
        self._slot_size = slot_size
        self._resident = resident if resident is not None and resident.enabled else None
        self._lock = lock
        self._clock = clock
        self._ring: Ring[SegmentSlot] = Ring(lock=lock)
        self._slots: list[SegmentSlot] = []  # every live segment of this session
        self._copy: ResidentCopy | None = None  # the resident copy of this checkpoint generation
        self._claimed = 0  # resident bytes claimed for this session's own segments
        self._upcoming: deque[Batch] = deque()  # batches still to get a kept segment, in plan order
        self._ahead: deque[tuple[Batch, Future[Segment]]] = deque()  # kept segments on their way
        # Batches that take one of the pool's segments, in plan order, with it (``None``: still on
        # its way when the load was planned, taken when the pipeline asks for it).
        self._adopting: deque[tuple[Batch, Segment | None]] = deque()
        self._adopted = False  # the pool gave segments: it makes its standing ring again at the end
        self._watching = False  # the pool wakes this session when it made a segment (:meth:`_grow`)
        self.ring_bound = 0  # the ring's slots at most, for ranks that page-lock (:meth:`bound_ring`; 0: the budget's)
        self._ended = False  # released: a slot whose holders let go goes straight back to the pool
        self._copy_held = False  # the session ended while ranks held batches: the copy stays pinned

    # ------------------------------------------------------------------ the resident copy

    def resident_batches(self, uri: str, generation: str, wanted: Sequence[TensorInfo], first: int) -> list[list[Handle]]:
        """The tensors of ``wanted`` an earlier load left in memory, as handles: one batch per
        segment, numbered from ``first``. Pins the copy for this session (``release`` unpins it)."""
        if self._resident is None:
            return []
        self._copy = copy = self._resident.pin(uri, generation)
        by_segment: dict[str, tuple[Segment, list[tuple[TensorInfo, int]]]] = {}
        for t in wanted:
            kept = copy.get(t.name) if t.nbytes else None
            if kept is not None:
                by_segment.setdefault(kept.segment.name, (kept.segment, []))[1].append((t, kept.offset))
        return [
            [handle(index, segment, offset, t) for t, offset in tensors]
            for index, (segment, tensors) in enumerate(by_segment.values(), first)
        ]

    def in_memory(self, uri: str, generation: str, tensors: Iterable[TensorInfo]) -> bool:
        """Whether an earlier load left every byte of ``tensors`` in memory now: a hint (what this
        session serves from memory is decided when its load starts, :meth:`resident_batches`).
        ``tensors`` is read only where a copy of ``uri`` at ``generation`` is kept."""
        return self._resident is not None and self._resident.holds(uri, generation, (t.name for t in tensors if t.nbytes))

    def served(self, nbytes: int) -> None:
        if self._resident is not None:
            self._resident.served(nbytes)

    def drop_resident(self, why: str) -> None:
        """Storage no longer holds what the resident copy is of (a changed or missing object)."""
        if self._copy is not None:
            self._resident.drop(self._copy, why)

    # ------------------------------------------------------------------ sizing and taking

    def bound_ring(self, in_flight: int | None) -> None:
        """Keep the ring to the slots a load takes before its ranks release any (the pool's
        standing ring, :func:`~streamer_service.sizing.first_ring_slots`), for ranks that page-lock
        the segments they copy from: each slot is registered once and reused, where a ring grown
        ahead of them towards the checkpoint's size is registered byte for byte. Not for a load
        that may be retained (its kept segments are new memory for every batch): :attr:`ring_bound`
        stays 0."""
        if self._resident is None:
            self.ring_bound = first_ring_slots(self._pool.budget.limit, self._slot_size, in_flight or self._slot_size)

    def prepare(self, plan: Plan, session: str) -> None:
        """Size the buffers for ``plan``: with room in the retention budget its bytes will stay
        resident (kept segments); otherwise they go through a ring of slots."""
        loaded = [b for b in plan.batches if b.ranges]  # the pipeline's order of acquire
        if self._copy is not None and loaded:
            self._retain(loaded, session)
        slot_batches = sum(b.kind is BatchKind.SLOT and b.buffer_bytes > 0 for b in plan.batches)
        # Ring segments are all of the daemon's slot size, so that later sessions can reuse them.
        bound = self.ring_bound * self._slot_size if self.ring_bound else None
        self._ring.capacity = ring_slots(self._pool.budget.limit, self._slot_size, slot_batches, cap_bytes=bound)

    def _retain(self, batches: list[Batch], session: str) -> None:
        """Claim room for ``batches`` in the retention budget (whole pages; a slot for each that
        takes one of the pool's segments); with no room they go through the ring."""
        pages = self._pool.store.pages
        slot = pages.round(self._slot_size)
        exact = sum(pages.round(b.buffer_bytes) for b in batches)
        fits = [b for b in batches if b.kind is BatchKind.SLOT][: self._pool.available(slot)]
        larger = sum(slot - pages.round(b.buffer_bytes) for b in fits)  # what the slot-sized ones add
        # The slot-sized segments only where they evict nothing the exact ones would not.
        self._claimed = self._resident.claim(self._copy, exact, extra=larger if fits else 0)
        if not self._claimed:
            log.info("session %s: %d bytes to load do not fit the retention budget; streaming through the ring", session, exact)
            return
        if fits and self._claimed == exact + larger:
            idle = self._pool.adopt(slot, len(fits), wait=False)  # out of the pool now: no other session takes them
            self._adopted = bool(idle)
            self._adopting.extend(itertools.zip_longest(fits, idle))  # None: still on its way
        else:
            fits = []
        adopting = {id(b) for b in fits}
        self._upcoming.extend(b for b in batches if id(b) not in adopting)
        self._make_ahead()

    def acquire(self, batch: Batch) -> SegmentSlot | None:
        """A segment for ``batch``: a kept one, a free ring slot, a new one while the ring may grow,
        or none (wait for a release)."""
        oversized = batch.kind is BatchKind.OVERSIZED
        if self._claimed:  # the claim pays: one of the pool's segments, or one of the batch's size made ahead
            slot = self._add(SegmentSlot(self._kept_segment(batch), None, oversized))
        else:
            nbytes = batch.buffer_bytes if oversized else self._slot_size
            slot = self._ring.take(functools.partial(self._new_slot, nbytes, oversized), oversized=oversized)
        if slot is not None:
            # Before the load writes into it: a rank still holding a handle of its last bytes
            # raises once it checks, instead of yielding this batch's (daemon.generations).
            slot.segment.bump()
        return slot

    @property
    def ring_slots(self) -> int:
        """Ring slots this session has (in use or free; none once released)."""
        return self._ring.made

    def _kept_segment(self, batch: Batch) -> Segment:
        if self._adopting and self._adopting[0][0] is batch:
            segment = self._adopting.popleft()[1]
            if segment is not None:
                return segment
            pages = self._pool.store.pages
            adopted = self._pool.adopt(pages.round(self._slot_size), 1)  # waits only for one on its way
            if adopted:
                self._adopted = True
                return adopted[0]
            # Another session took it once made: a segment of the batch's size, and the claim shrinks to it.
            larger = pages.round(self._slot_size) - pages.round(batch.buffer_bytes)
            self._resident.settle(larger)
            self._claimed -= larger
            return self._pool.store.create(batch.buffer_bytes)
        if self._ahead and self._ahead[0][0] is batch:
            future = self._ahead.popleft()[1]
            self._make_ahead()
            return future.result()  # a full shm dir: the ConfigError of Segment, raised here
        return self._pool.store.create(batch.buffer_bytes)  # not a batch of the plan's order

    def _make_ahead(self) -> None:
        while self._upcoming and len(self._ahead) < KEPT_AHEAD:
            batch = self._upcoming.popleft()
            self._ahead.append((batch, self._pool.store.create_soon(batch.buffer_bytes)))

    def _new_slot(self, nbytes: int, oversized: bool) -> SegmentSlot | None:
        if not oversized and self._ring.made and self._pool.makes_ahead:
            got = self._grow(nbytes)
        else:
            got = self._pool.take(nbytes, oversized=oversized)
            if got is not None and not oversized:  # the ring's next slots are made off this thread meanwhile
                self._pool.make_ahead(nbytes, min(RING_AHEAD, self._ring.room))
        if got is None:  # wait for a release (or for a segment on its way)
            return None
        return self._add(SegmentSlot(got[0], got[1], oversized))

    def _grow(self, nbytes: int) -> tuple[Segment, Reservation] | None:
        """A segment for the ring to grow by, never zero-filled on the load's thread while a release
        may come (every slot the ring has is in flight or held by ranks): one made already, else
        ``None`` while the store's threads make it, and the load takes whichever comes first, a
        released slot or the new segment (the pool wakes the session: :meth:`_wake`)."""
        if not self._watching:
            self._pool.watch(self._wake)
            self._watching = True
        got = self._pool.take_made(nbytes)
        self._pool.make_ahead(nbytes, min(RING_AHEAD, self._ring.room + (got is None)))
        if got is None and not self._pool.available(nbytes):
            # Nothing is on its way (the budget is held by idle segments of other sizes, which only a
            # take evicts, or by other sessions): the load's thread takes one itself, as a first slot.
            got = self._pool.take(nbytes)
        return got

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _add(self, slot: SegmentSlot) -> SegmentSlot:
        with self._lock:
            self._slots.append(slot)
        return slot

    # ------------------------------------------------------------------ after a batch is loaded

    def keep(self, slot: SegmentSlot, placements: Sequence[Placement]) -> None:
        """A loaded kept segment: its tensors join the resident copy, which owns it from now on."""
        if slot.kept:
            self._resident.add(
                self._copy, slot.segment, [(p.tensor.name, p.buffer_offset) for p in placements if p.tensor.nbytes]
            )
            slot.resident = True

    def recycle(self, slot: SegmentSlot) -> None:
        """Every rank released ``slot``'s batch (called under the lock)."""
        if self._ended:  # a slot that outlived its session: no ring takes it back
            self._slots.remove(slot)
            if not slot.kept:
                self._pool.give(slot.segment, slot.reservation, keep=True, now=self._clock())
            elif not slot.resident:
                slot.segment.close()
            return
        if slot.kept:
            return  # the resident copy owns it now
        if slot.oversized:
            self._slots.remove(slot)
            # Ranks dropped their mappings of it when they released it; kept idle for a reload.
            self._pool.give(slot.segment, slot.reservation, keep=True, now=self._clock())
        self._ring.give(slot, oversized=slot.oversized)

    def release(self, held: Callable[[], Iterable[SegmentSlot]] = tuple, holding: Callable[[], bool] = bool) -> None:
        """The session ended: ring segments go back to the pool, the claim is settled; but for the
        slots ``held()`` names (asked under the lock): ranks still hold their batches, and each goes
        back when they let go (:meth:`recycle`). While ``holding()`` (any batch held, the resident
        copy's too) the copy stays pinned, until :meth:`unheld`."""
        if self._watching:
            self._pool.unwatch(self._wake)
            self._watching = False
        with self._lock:
            kept = {id(slot) for slot in held()}
            every = self._slots
            slots = [slot for slot in every if id(slot) not in kept]
            self._slots = [slot for slot in every if id(slot) in kept]
            self._ring.drain()
            self._ended = True
            self._copy_held = holding()
            unpin = not self._copy_held  # else the last holder's release unpins it (:meth:`unheld`)
        ahead, self._ahead = self._ahead, deque()
        adopting, self._adopting = self._adopting, deque()
        self._upcoming.clear()
        for _, future in ahead:  # made for batches the load never reached
            with contextlib.suppress(Exception):
                future.result().close()
        # Adopted for batches the load never reached: back to the pool, which then makes the rest.
        self._pool.restore([segment for _, segment in adopting if segment is not None])
        if self._adopted:
            self._pool.restand()
        for slot in slots:
            if not slot.kept:
                self._pool.give(slot.segment, slot.reservation, keep=True, now=self._clock())
            elif not slot.resident:
                slot.segment.close()  # claimed but never filled: the load failed first
        if self._copy is not None:
            self._resident.settle(self._claimed - sum(s.segment.nbytes for s in every if s.resident))
            if unpin:
                self._resident.unpin(self._copy)

    def unheld(self) -> None:
        """No rank holds any batch of the ended session any more: the resident copy is unpinned."""
        if self._ended and self._copy_held and self._copy is not None:
            self._copy_held = False
            self._resident.unpin(self._copy)
