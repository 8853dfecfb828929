"""A fresh daemon's first load: segments made at start, and kept segments made ahead of need.

In-process, as ``test_session``: real shared-memory segments, the fake reader of that module. The
daemon-process side (a full shm dir while segments are prepared or made ahead) is in
``test_processes``.
"""

from __future__ import annotations

import threading
import time

import pytest
from daemon_harness import segment_files
from test_session import (
    FakeReader,
    _consume,
    _join_all,
    _truth,
    checkpoint_dir,  # noqa: F401 - the fixture: the same 4 MB sample
)

from streamer_service.checkpoint.open import open_checkpoint
from streamer_service.checkpoint.plan import BatchKind, build_plan
from streamer_service.daemon.resident import ResidentStore
from streamer_service.daemon.segment_pool import SegmentPool
from streamer_service.daemon.session import Session, SessionState
from streamer_service.daemon.session_buffers import SessionBuffers
from streamer_service.daemon.shm import SegmentStore, ShmBudget
from streamer_service.settings import Settings

SLOT = 512 * 1024


class RecordingStore(SegmentStore):
    """A real store that notes which thread made each segment (a spy: nothing is faked); a maker
    thread waits for ``gate`` before it makes one (open unless a test closes it). ``makers_left``:
    how many more segments :meth:`create_soon` may hand to a maker thread before it fails as
    ``ThreadPoolExecutor.submit`` does when no thread can be started (None: no limit)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.made_by: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.makers_left: int | None = None

    def create_soon(self, nbytes: int):
        if self.makers_left is not None:
            if self.makers_left == 0:
                raise RuntimeError("can't start new thread")
            self.makers_left -= 1
        return super().create_soon(nbytes)

    def create(self, nbytes: int):
        if threading.current_thread().name.startswith("segment-maker"):
            assert self.gate.wait(60)
        self.made_by.append(threading.current_thread().name)
        return super().create(nbytes)


@pytest.fixture
def node(tmp_path, checkpoint_dir):  # noqa: F811 - the imported fixture, by name
    """A daemon's segment store as in ``test_session``; the test makes its pools (budget, idle_s)."""
    checkpoint = open_checkpoint(str(checkpoint_dir), Settings(cache_dir=tmp_path / "cache"))
    pools: list[SegmentPool] = []
    (shm := tmp_path / "segments").mkdir()
    store = RecordingStore(shm)
    store.open()

    def pool(budget: int, idle_s: float = 30) -> SegmentPool:
        pools.append(SegmentPool(store, ShmBudget(budget), idle_s))
        return pools[-1]

    def session(pool: SegmentPool, resident: ResidentStore | None = None, reader_factory=None) -> Session:
        return Session(
            "key", checkpoint, 1, slot_size=SLOT, pool=pool, join_timeout_s=60, on_end=lambda s: None,
            resident=resident, reader_factory=reader_factory or (lambda **k: FakeReader([], **k)),
        )  # fmt: skip

    yield type("Node", (), {"pool": staticmethod(pool), "session": staticmethod(session), "store": store, "shm": shm,
                            "checkpoint": checkpoint, "dir": checkpoint_dir})  # fmt: skip
    for p in pools:
        p.close()
    store.close()
    assert list(shm.iterdir()) == []  # closing the pool and the store leaves no segment behind


def _prepared(pool: SegmentPool) -> None:
    deadline = time.monotonic() + 60
    while pool.preparing and time.monotonic() < deadline:  # a wait, not a timed assertion
        time.sleep(0.01)
    assert not pool.preparing


def _load(node, pool, resident=None) -> Session:
    session = node.session(pool, resident)
    _join_all(session, [None])
    got = _consume(session, 0, node.shm)
    assert session.wait_ended(60) and session.state is SessionState.DONE
    assert [n for n, _ in got] == [t.name for t in node.checkpoint.catalog.tensors]
    assert all(data == _truth(node.checkpoint, n, node.dir) for n, data in got)
    return session


def test_a_fresh_daemons_first_load_takes_the_segments_prepared_at_start(node):
    pool = node.pool(4 * SLOT)
    pool.start_preparing(SLOT, 4)
    _prepared(pool)
    prepared = {p.name for p in segment_files(node.shm)}
    assert pool.prepared == len(prepared) == 4 and pool.budget.in_use == 4 * SLOT
    assert all(name.startswith("segment-maker") for name in node.store.made_by)  # not on a load's thread
    made_before = len(node.store.made_by)

    _load(node, pool)

    oversized = build_plan(node.checkpoint.catalog.tensors, SLOT).oversized_bytes
    # The load made no ring segment of its own: only a tensor larger than a slot got a new one.
    assert len(node.store.made_by) - made_before <= sum(t.nbytes > SLOT for t in node.checkpoint.catalog.tensors)
    assert pool.reused >= 1 and prepared <= {p.name for p in segment_files(node.shm)}  # the same files, kept idle
    assert pool.budget.peak <= pool.budget.limit + oversized and pool.budget.in_use <= pool.budget.limit


def test_prepared_segments_wait_for_the_first_load_then_go_once_idle(node):
    pool = node.pool(4 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 2)
    _prepared(pool)
    pool.trim(time.monotonic() + 10**6)
    assert pool.idle == 2 and len(list(segment_files(node.shm))) == 2  # however late the first load comes
    started = time.monotonic()
    segment, reservation = pool.take(SLOT)  # the first load's first request
    assert pool.reused == 1
    pool.give(segment, reservation, keep=True, now=started + 1000)  # given back (much) later
    pool.trim(started + 4.9)
    assert pool.idle == 2
    pool.trim(time.monotonic() + 5)  # idle_s after the first request: the untouched prepared one goes
    assert pool.idle == 1
    pool.trim(started + 1005)
    assert pool.idle == 0 and pool.budget.in_use == 0 and list(node.shm.iterdir()) == []


def test_preparing_stays_within_the_budget_and_a_load_waits_for_segments_on_their_way(node):
    pool = node.pool(3 * SLOT)
    pool.start_preparing(SLOT, 10)
    got = pool.take(SLOT)  # the budget is all reserved for segments being made: one of them
    assert got is not None and pool.reused == 1
    _prepared(pool)
    assert pool.prepared == 3 and pool.budget.in_use == pool.budget.peak == 3 * SLOT
    assert len(list(segment_files(node.shm))) == 3
    pool.give(*got, keep=False, now=0.0)


def test_a_retained_load_makes_its_segments_ahead_and_keeps_exactly_what_it_filled(node):
    pool = node.pool(4 * SLOT, idle_s=0)
    resident = ResidentStore(64 * 2**20)
    _load(node, pool, resident)
    batches = len(node.store.made_by)
    assert batches and all(name.startswith("segment-maker") for name in node.store.made_by)  # off the load's thread
    stats = resident.stats()
    files = list(segment_files(node.shm))
    assert len(files) == batches and sum(f.stat().st_size for f in files) == stats.resident_bytes == resident.used
    resident.close()


class HeldReader(FakeReader):
    """A :class:`FakeReader` that answers its first ``first`` ranges, then waits for ``go``."""

    def __init__(self, log: list[int], first: int, go: threading.Event, **kw: object) -> None:
        super().__init__(log, **kw)
        self._first = first
        self._go = go

    def answer(self, wait_s=None):
        if self._first:
            self._first -= 1
        else:
            assert self._go.wait(60)
        return super().answer(wait_s)


def test_an_abandoned_retained_load_unlinks_the_segments_made_ahead_for_it(node):
    pool = node.pool(4 * SLOT, idle_s=0)
    resident = ResidentStore(64 * 2**20)
    # Storage answers the first batch, then nothing until its rank left: the load cannot end before.
    go = threading.Event()
    first = len(build_plan(node.checkpoint.catalog.tensors, SLOT).batches[0].ranges)
    session = node.session(pool, resident, reader_factory=lambda **k: HeldReader([], first, go, **k))
    _join_all(session, [None])
    assert _consume(session, 0, node.shm, stop_after=1)
    session.leave(0)
    go.set()
    assert session.wait_ended(60) and session.state is SessionState.FAILED
    files = list(segment_files(node.shm))
    # Only the batches that were loaded stay (the resident copy's); the rest made ahead are gone.
    assert sum(f.stat().st_size for f in files) == resident.stats().resident_bytes == resident.used
    assert len(files) < len(node.store.made_by)
    resident.close()
    assert list(node.shm.iterdir()) == []


def test_a_ring_that_grows_makes_its_next_slots_off_the_loads_thread_within_the_budget(node):
    """No segment prepared at start: once the ring grows, its next slots are made on the store's
    maker threads; the bytes are exact, the budget holds (segments made ahead included; one
    oversized tensor's buffer may go past it, as always), and
    every segment is gone when the pool closes (the fixture checks)."""
    pool = node.pool(6 * SLOT)
    _load(node, pool)
    assert any(name.startswith("segment-maker") for name in node.store.made_by)
    oversized = build_plan(list(node.checkpoint.catalog.tensors), SLOT).oversized_bytes
    assert pool.budget.peak <= 6 * SLOT + node.store.pages.round(oversized)  # the one oversized buffer beyond it
    _prepared(pool)
    assert pool.budget.in_use == sum(1 for _ in segment_files(node.shm)) * SLOT  # idle ones, all accounted


def test_a_growing_ring_goes_on_with_released_slots_while_its_next_segments_are_being_made(node):
    """The budget lets the ring grow, but the store's threads are held before they make anything:
    the load's thread makes its first slot and then goes on with the slots the rank releases,
    instead of waiting for a zero-fill while a release can come; every tensor is byte-exact."""
    pool = node.pool(6 * SLOT)
    node.store.gate.clear()  # the maker threads wait at the gate
    # A load that waits for the makers instead ends only once the gate opens, and fails below.
    opener = threading.Timer(30, node.store.gate.set)
    opener.start()
    try:
        _load(node, pool)
        on_the_loads_thread = [name for name in node.store.made_by if not name.startswith("segment-maker")]
        oversized = sum(b.kind is BatchKind.OVERSIZED for b in _loaded_batches(node))
        assert len(on_the_loads_thread) == 1 + oversized  # the first slot, and each oversized tensor's own
        assert len(node.store.made_by) == len(on_the_loads_thread)  # the makers made nothing meanwhile
    finally:
        opener.cancel()
        node.store.gate.set()
    _prepared(pool)  # what the makers were asked for comes, and stays idle
    assert pool.idle >= 1 and pool.budget.in_use <= pool.budget.limit


def test_the_pool_calls_its_watchers_once_a_segment_is_made_ahead_and_idle(node):
    pool = node.pool(4 * SLOT)
    found: list = []

    def watcher() -> None:
        found.append(pool.take_made(SLOT))  # the segment is idle by the time the watcher runs

    pool.watch(watcher)
    pool.start_preparing(SLOT, 2)
    _prepared(pool)
    assert len(found) == 2 and None not in found and pool.idle == 0
    assert pool.take_made(SLOT) is None  # nothing idle left, nothing made here
    pool.unwatch(watcher)
    pool.start_preparing(SLOT, 1)
    _prepared(pool)
    assert len(found) == 2 and pool.idle == 1
    for segment, reservation in found:
        pool.give(segment, reservation, keep=False, now=0.0)


def test_no_segment_is_made_ahead_when_none_may_stay_idle(node):
    pool = node.pool(6 * SLOT, idle_s=0)
    _load(node, pool)
    assert not any(name.startswith("segment-maker") for name in node.store.made_by)
    assert pool.budget.in_use == 0 and list(node.shm.iterdir()) == []


def test_the_standing_ring_stays_idle_for_good_and_only_what_a_load_grew_past_it_goes(node):
    pool = node.pool(6 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 2, standing=True)
    _prepared(pool)
    standing = {p.name for p in segment_files(node.shm)}
    started = time.monotonic()
    taken = [pool.take(SLOT) for _ in range(4)]  # a load's ring: the two standing segments and two new
    assert pool.reused == 2 and None not in taken and len(list(segment_files(node.shm))) == 4
    for segment, reservation in taken:
        pool.give(segment, reservation, keep=True, now=started)
    pool.trim(started + 4.9)
    assert pool.idle == 4
    pool.trim(started + 10**6)  # long idle: the ring's growth goes, two segments of the slot size stay
    assert pool.idle == 2 and len(list(segment_files(node.shm))) == 2 and pool.budget.in_use == 2 * SLOT
    again = pool.take(SLOT)  # the next load, however late, starts on allocated segments
    assert pool.reused == 3 and again[0].name in {s.name for s, _ in taken}
    pool.give(*again, keep=True, now=started + 10**6)
    assert {p.name for p in segment_files(node.shm)} <= standing | {s.name for s, _ in taken}


def test_without_a_standing_ring_every_idle_segment_goes(node):
    pool = node.pool(8 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 2)
    _prepared(pool)
    now = time.monotonic()
    for nbytes, oversized in ((SLOT, False), (3 * SLOT, True)):
        segment, reservation = pool.take(nbytes, oversized=oversized)
        pool.give(segment, reservation, keep=True, now=now)
    pool.trim(now + 10**6)
    assert pool.idle == 0 and list(node.shm.iterdir()) == []


def test_the_segment_that_went_idle_last_is_taken_first(node):
    """A load takes the segments the last one gave back before older idle ones, so those no load
    needs any more age out and go."""
    pool = node.pool(4 * SLOT, idle_s=5)
    now = time.monotonic()
    older, newer = pool.take(SLOT), pool.take(SLOT)
    pool.give(*older, keep=True, now=now)
    pool.give(*newer, keep=True, now=now + 1)
    again = pool.take(SLOT)
    assert again[0].name == newer[0].name
    pool.give(*again, keep=True, now=now + 2)
    pool.trim(now + 5.5)  # only the older one was idle for 5 s
    assert {p.name for p in segment_files(node.shm)} == {newer[0].name}


def test_the_oversized_segment_that_went_idle_last_stands_with_the_ring(node):
    """Two loads' oversized tensors (3 and 2 slots): after a long idle spell the standing ring
    and the later one's segment are still there, the earlier one's went; the next load of a
    tensor of that size takes it as it is."""
    pool = node.pool(8 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 2, standing=True)
    _prepared(pool)
    standing = {p.name for p in segment_files(node.shm)}
    started = time.monotonic()
    earlier = pool.take(3 * SLOT, oversized=True)
    pool.give(*earlier, keep=True, now=started)
    later = pool.take(2 * SLOT, oversized=True)
    pool.give(*later, keep=True, now=started + 1)
    pool.trim(started + 5.5)  # the earlier one is stale, the later not yet: only the earlier goes
    assert {p.name for p in segment_files(node.shm)} == standing | {later[0].name}
    pool.trim(started + 10**6)
    assert {p.name for p in segment_files(node.shm)} == standing | {later[0].name}
    assert pool.idle == 3 and pool.budget.in_use == 4 * SLOT
    reused = pool.reused
    again = pool.take(2 * SLOT, oversized=True)
    assert again[0].name == later[0].name and pool.reused == reused + 1
    pool.give(*again, keep=True, now=started + 10**6)


def _standing_ring(node) -> tuple[SegmentPool, set[str]]:
    """A pool of four slots whose standing ring of two is made, and the names of its segments."""
    pool = node.pool(4 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 2, standing=True)
    _prepared(pool)
    return pool, {p.name for p in segment_files(node.shm)}


def _loaded_batches(node) -> list:
    return [b for b in build_plan(list(node.checkpoint.catalog.tensors), SLOT).batches if b.ranges]


def test_a_retained_load_keeps_the_standing_ring_for_its_first_batches_and_the_pool_makes_it_again(node):
    pool, standing = _standing_ring(node)
    made_before = len(node.store.made_by)
    resident = ResidentStore(64 * 2**20)

    _load(node, pool, resident)  # every tensor byte-exact
    _prepared(pool)

    batches = _loaded_batches(node)
    first_two = [b for b in batches if b.kind is BatchKind.SLOT][:2]
    copy = resident.pin(node.checkpoint.uri.normalized, node.checkpoint.generation)
    try:
        # The first two slot batches were streamed into the standing ring's segments, which stay resident.
        assert {copy.get(p.tensor.name).segment.name for b in first_two for p in b.placements if p.tensor.nbytes} == standing
    finally:
        resident.unpin(copy)
    # Only the other batches needed new segments, and the pool made its two standing ones again.
    assert len(node.store.made_by) - made_before == len(batches) - 2 + 2
    assert all(name.startswith("segment-maker") for name in node.store.made_by)
    assert pool.idle == 2 and pool.budget.in_use == 2 * SLOT  # the adopted ones left the ring's budget
    files = {p.name: p.stat().st_size for p in segment_files(node.shm)}
    assert len(files) == len(batches) + 2
    assert resident.used == resident.stats().resident_bytes == sum(files.values()) - 2 * SLOT
    resident.close()
    remaining = {p.name for p in segment_files(node.shm)}
    assert len(remaining) == 2 and remaining.isdisjoint(standing)  # the standing ring, new segments


def test_a_retention_budget_with_room_only_for_exact_segments_leaves_the_standing_ring_alone(node):
    pool, standing = _standing_ring(node)
    pages = node.store.pages
    exact = sum(pages.round(b.buffer_bytes) for b in _loaded_batches(node))
    slot_batches = [b for b in _loaded_batches(node) if b.kind is BatchKind.SLOT][:2]
    assert sum(pages.round(SLOT) - pages.round(b.buffer_bytes) for b in slot_batches) > 0  # the test means something
    resident = ResidentStore(exact)  # not enough for two slot-sized segments in place of their batches'

    _load(node, pool, resident)

    assert resident.used == resident.stats().resident_bytes == exact  # every batch kept, in a segment of its size
    assert pool.idle == 2 and pool.budget.in_use == 2 * SLOT
    resident.close()
    assert {p.name for p in segment_files(node.shm)} == standing  # the standing ring was not touched


def test_adopted_segments_leave_the_pool_and_its_budget_and_restand_makes_them_again(node):
    pool = node.pool(4 * SLOT, idle_s=5)
    pool.start_preparing(SLOT, 3, standing=True)
    assert pool.available(SLOT) == 3  # idle or on their way
    adopted = pool.adopt(SLOT, 2)  # waits for the prepared segments still being made
    assert len(adopted) == 2 and all(s.nbytes == SLOT for s in adopted)
    _prepared(pool)
    assert pool.idle == pool.available(SLOT) == 1 and pool.budget.in_use == SLOT
    assert pool.adopt(2 * SLOT, 1) == []  # none of that size: nothing is made for it
    pool.restand()
    _prepared(pool)
    assert pool.idle == 3 and pool.budget.in_use == 3 * SLOT
    assert len(list(segment_files(node.shm))) == 5  # the adopted two are the adopter's to close
    for segment in adopted:
        segment.close()


def _retaining(node, pool, resident):
    """Session buffers planned for a retained load of the whole sample, and the plan's first slot batch."""
    buffers = SessionBuffers(pool, SLOT, resident, lock=threading.Condition(), clock=time.monotonic)
    tensors = list(node.checkpoint.catalog.tensors)
    assert buffers.resident_batches(node.checkpoint.uri.normalized, node.checkpoint.generation, tensors, 0) == []
    plan = build_plan(tensors, SLOT)
    buffers.prepare(plan, "key")
    first = next(b for b in plan.batches if b.kind is BatchKind.SLOT)
    exact = sum(node.store.pages.round(b.buffer_bytes) for b in plan.batches if b.ranges)
    return buffers, first, exact


def test_a_retained_batch_whose_segment_another_session_took_once_made_gets_one_of_its_size(node):
    pool = node.pool(4 * SLOT, idle_s=5)
    node.store.gate.clear()
    pool.start_preparing(SLOT, 1, standing=True)  # on its way: counted when the load is planned
    resident = ResidentStore(64 * 2**20)
    buffers, first, exact = _retaining(node, pool, resident)
    pages = node.store.pages
    assert resident.used == exact + SLOT - pages.round(first.buffer_bytes)  # a whole slot claimed for it
    node.store.gate.set()
    _prepared(pool)
    stolen = pool.take(SLOT)  # another session's ring takes it before the batch asks
    slot = buffers.acquire(first)
    assert slot.kept and slot.segment.nbytes == pages.round(first.buffer_bytes) < SLOT
    assert resident.used == exact  # the claim shrank to the segment it got
    buffers.release()  # nothing was loaded: the claim is settled, the segments made ahead go
    assert resident.used == 0
    pool.give(*stolen, keep=True, now=time.monotonic())
    resident.close()


def test_a_second_retained_load_planned_meanwhile_leaves_the_first_its_segments(node):
    pool, standing = _standing_ring(node)
    resident = ResidentStore(64 * 2**20)
    one, first, exact = _retaining(node, pool, resident)  # takes both idle segments as it is planned
    assert pool.idle == pool.available(SLOT) == 0 and pool.budget.in_use == 0
    other_resident = ResidentStore(64 * 2**20)
    other = SessionBuffers(pool, SLOT, other_resident, lock=threading.Condition(), clock=time.monotonic)
    other.resident_batches("other", "g", list(node.checkpoint.catalog.tensors), 0)
    plan = build_plan(list(node.checkpoint.catalog.tensors), SLOT)
    other.prepare(plan, "other")
    # The other load's first batch: a segment of its size, made ahead on a maker thread.
    got = other.acquire(next(b for b in plan.batches if b.kind is BatchKind.SLOT))
    assert got.segment.nbytes == node.store.pages.round(first.buffer_bytes) and got.segment.name not in standing
    assert one.acquire(first).segment.name in standing  # the first load's, untouched
    other.release()
    one.release()
    _prepared(pool)
    assert pool.idle == 2  # the standing ring, made again
    resident.close()
    other_resident.close()


def _other_copy(node, resident: ResidentStore, nbytes: int, *, pinned: bool = False):
    """Another checkpoint's resident copy: one segment of ``nbytes``; ``pinned``: a session serves from it."""
    copy = resident.pin(f"file:///other-{nbytes}-{pinned}", "g")
    assert resident.claim(copy, nbytes) == nbytes
    resident.add(copy, node.store.create(nbytes), [("t", 0)])
    if not pinned:
        resident.unpin(copy)
    return copy


@pytest.mark.parametrize("other_is_smaller", [True, False], ids=["smaller-than-the-slot-rounding", "larger"])
def test_slot_sized_segments_evict_no_copy_the_exact_ones_fit_beside(node, other_is_smaller):
    pool, standing = _standing_ring(node)
    pages = node.store.pages
    batches = _loaded_batches(node)
    exact = sum(pages.round(b.buffer_bytes) for b in batches)
    larger = sum(pages.round(SLOT) - pages.round(b.buffer_bytes) for b in [b for b in batches if b.kind is BatchKind.SLOT][:2])
    # Smaller: evicting it would not make room for the slot rounding; larger: it would.
    other = pages.size if other_is_smaller else pages.round(larger) + pages.size
    busy = pages.round(larger)  # a copy a session serves from: never evicted
    resident = ResidentStore(exact + other + busy)  # this load's exact segments fit beside both copies
    serving = _other_copy(node, resident, busy, pinned=True)
    _other_copy(node, resident, other)
    buffers, first, _ = _retaining(node, pool, resident)
    try:
        assert resident.evictions == 0 and resident.used == exact + other + busy  # exact segments, both copies kept
        assert pool.idle == 2 and buffers.acquire(first).segment.name not in standing
    finally:
        buffers.release()
        resident.unpin(serving)
        resident.close()


def test_a_retained_load_that_ends_before_its_adopted_segments_gives_them_back_to_the_pool(node):
    pool, standing = _standing_ring(node)
    resident = ResidentStore(64 * 2**20)
    buffers, first, _ = _retaining(node, pool, resident)
    assert pool.idle == 0 and pool.budget.in_use == 0  # adopted
    buffers.release()  # cancelled before its first batch
    _prepared(pool)
    # The same two segments, idle again, and none made in their place.
    assert pool.idle == 2 and pool.budget.in_use == 2 * SLOT and resident.used == 0
    assert {p.name for p in segment_files(node.shm)} == standing
    resident.close()


def test_a_session_that_ends_while_the_daemon_stops_makes_no_segment_for_the_pool_to_close(node):
    pool, standing = _standing_ring(node)
    resident = ResidentStore(64 * 2**20)
    buffers, first, _ = _retaining(node, pool, resident)
    used = buffers.acquire(first).segment  # one adopted segment in use, never filled
    pool.stop_making()  # Daemon.tell_stopping, before it cancels the sessions
    buffers.release()
    # The one never reached is back; the ring is not made again.
    assert not pool.preparing and pool.idle == pool.available(SLOT) == 1
    assert {p.name for p in segment_files(node.shm)} == standing - {used.name}
    pool.close()
    assert list(node.shm.iterdir()) == [] and pool.budget.in_use == 0
    resident.close()


def test_a_maker_thread_that_cannot_start_gives_every_reservation_back(node):
    pool = node.pool(4 * SLOT, idle_s=5)
    node.store.makers_left = 1
    with pytest.raises(RuntimeError, match="can't start new thread"):
        pool.start_preparing(SLOT, 3, standing=True)
    _prepared(pool)  # the one that started; none is left counted as on its way
    assert pool.idle == 1 and pool.budget.in_use == SLOT
    taken = [pool.take(SLOT), pool.take(SLOT)]  # neither waits for a segment never coming
    assert None not in taken
    for segment, reservation in taken:
        pool.give(segment, reservation, keep=False, now=time.monotonic())
