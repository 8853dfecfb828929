"""The daemon's session state machine in-process: real shared-memory segments, a fake reader.

The fake reader (below, tests only) copies the requested byte ranges of local files into the
destination addresses, as Run:ai's native reader does, and records what it was asked to read, so
a test sees exactly what a session submits. Ranks are threads calling the session as the HTTP
layer does.
"""

from __future__ import annotations

import ctypes
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer_client._protocol import Handle
from streamer_client.errors import SessionError, StreamerError
from streamer_service.checkpoint import versions as versions_module
from streamer_service.checkpoint.open import open_checkpoint
from streamer_service.checkpoint.plan import select
from streamer_service.checkpoint.versions import ObjectVersions
from streamer_service.daemon.segment_pool import SegmentPool
from streamer_service.daemon.session import Session, SessionState
from streamer_service.daemon.shm import SegmentStore, ShmBudget
from streamer_service.readers.base import RangeResult
from streamer_service.sample import build_sample, rank_selection
from streamer_service.settings import Settings
from streamer_service.sizing import first_ring_slots

SLOT = 512 * 1024


class FakeReader:
    """Reads local files into the destinations when asked for answers; logs every submission."""

    submitted: list[int]  # bytes of each submission, shared by every reader of one test

    def __init__(self, log: list[int], **_: object) -> None:
        self.submitted = log
        self._pending: deque[tuple[int, int, int, str, object]] = deque()
        self._next_id = 0

    def __enter__(self) -> FakeReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        pass

    def close(self) -> None:
        self._pending.clear()

    def submit(self, files, keepalive) -> int:
        self._next_id += 1
        ranges = [(fi, ri, f.path, r) for fi, f in enumerate(files) for ri, r in enumerate(f.ranges)]
        self.submitted.append(sum(r.nbytes for *_, r in ranges))
        for n, (fi, ri, path, r) in enumerate(ranges):
            self._pending.append((self._next_id, fi, ri, path, r, n == len(ranges) - 1))
        return self._next_id

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def answer(self, wait_s=None):
        if not self._pending:
            return None
        submission, fi, ri, path, r, last = self._pending.popleft()
        with open(path, "rb") as f:
            f.seek(r.offset)
            data = f.read(r.nbytes)
        ctypes.memmove(r.dst, data, r.nbytes)
        return RangeResult(submission, fi, ri, path, r, last, None)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("session") / "ckpt"
    build_sample(src, size_mb=4)
    return src


@pytest.fixture
def node(tmp_path, checkpoint_dir):
    """What a daemon gives a session: the opened checkpoint and a segment pool on a shm dir."""
    shm = tmp_path / "segments"
    shm.mkdir()
    store = SegmentStore(shm)
    store.open()
    pool = SegmentPool(store, ShmBudget(4 * SLOT), idle_s=0)
    checkpoint = open_checkpoint(str(checkpoint_dir), Settings(cache_dir=tmp_path / "cache"))
    ended: list[Session] = []
    submitted: list[int] = []

    def session(world: int, **kw) -> Session:
        return Session(
            "key", checkpoint, world, slot_size=SLOT, pool=pool, join_timeout_s=60, on_end=ended.append,
            reader_factory=lambda **k: FakeReader(submitted, **k), **kw,
        )  # fmt: skip

    yield type("Node", (), {"session": staticmethod(session), "ended": ended, "submitted": submitted, "shm": shm,
                            "checkpoint": checkpoint, "dir": checkpoint_dir})  # fmt: skip
    pool.close()
    store.close()


def _join_all(session: Session, selections, priority=None, *, pins: bool = False) -> None:
    catalog = session.checkpoint.catalog.tensors
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            session.join(rank, len(selections), select(catalog, selections[rank], priority), priority, pins=pins)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(len(selections))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def _consume(session: Session, rank: int, shm: Path, stop_after: int | None = None) -> list[tuple[str, bytes]]:
    """A rank as the client is: read each batch's bytes out of the segment files, release, repeat."""
    got: list[tuple[str, bytes]] = []
    release: list[int] = []
    while True:
        handles, done = session.next(rank, release, 5.0)
        release = []
        for h in handles:
            got.append((h.name, _bytes(h, shm)))
            if h.segment is not None and h.batch not in release:
                release.append(h.batch)
        if stop_after is not None and len(got) >= stop_after:
            return got
        if done:
            session.next(rank, release, 0)
            session.leave(rank)
            return got


def _bytes(h: Handle, shm: Path) -> bytes:
    """``h``'s bytes, read out of its segment file."""
    if h.segment is None:
        return b""
    with open(shm / h.segment, "rb") as f:
        f.seek(h.offset)
        return f.read(h.nbytes)


def _hold(session: Session, rank: int, wait_s: float) -> list[Handle]:
    """Take, release nothing: the ring fills and the load waits for the rank; every handle taken
    until a request waits ``wait_s`` for nothing."""
    taken: list[Handle] = []
    holding = False  # a batch with bytes is held
    while True:
        handles = session.next(rank, [], wait_s if holding else 10.0)[0]
        if not handles and holding:
            return taken
        taken += handles
        holding = holding or any(h.segment is not None for h in handles)


def _truth(checkpoint, name: str, src: Path) -> bytes:
    t = checkpoint.catalog[name]
    with open(src / t.file, "rb") as f:
        f.seek(t.offset)
        return f.read(t.nbytes)


def _run_ranks(session: Session, world: int, shm: Path) -> list[list[tuple[str, bytes]]]:
    results: list = [None] * world
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, _consume(session, r, shm))) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


PRIORITIES = [None, ["model.norm.weight"], ["model.layers.1.", "lm_head.weight"], ["model.layers.3.mlp.", "model.embed_tokens."]]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(priority=st.sampled_from(PRIORITIES), world=st.integers(1, 3))
def test_each_rank_gets_its_bytes_in_the_embedded_order(node, priority, world):
    """Through the state machine: daemon order == ``plan.select`` order, every byte exact."""
    names = [t.name for t in node.checkpoint.catalog.tensors]
    selections = [None if world == 1 else rank_selection(names, r, world) for r in range(world)]
    try:
        embedded = [[t.name for t in select(node.checkpoint.catalog.tensors, s, priority)] for s in selections]
    except Exception:  # a priority entry outside a rank's selection: not this property's case
        return
    session = node.session(world)
    _join_all(session, selections, priority)
    results = _run_ranks(session, world, node.shm)
    assert session.wait_ended(60) and session.state is SessionState.DONE
    for rank, got in enumerate(results):
        assert [n for n, _ in got] == embedded[rank]
        assert all(data == _truth(node.checkpoint, n, node.dir) for n, data in got)
    assert sum(node.submitted) == sum(
        t.nbytes for t in node.checkpoint.catalog.tensors if any(t.name in e for e in map(set, embedded))
    )
    node.submitted.clear()
    assert list(node.shm.iterdir()) == []


def test_a_load_no_rank_reads_stops_submitting(node):
    """Both ranks leave after their first reply; the session submits nothing more."""
    total = sum(t.nbytes for t in node.checkpoint.catalog.tensors)
    session = node.session(2)
    _join_all(session, [None, None])
    for rank in range(2):
        assert _consume(session, rank, node.shm, stop_after=1)
    read_before = sum(node.submitted)
    for rank in range(2):
        session.leave(rank)
    assert session.wait_ended(60)
    assert session.state is SessionState.FAILED and session.error is None
    assert {r.status for r in session.summary().ranks.values()} == {"left"}
    # In flight when they left: at most the ring (4 slots) and one oversized tensor more.
    assert sum(node.submitted) - read_before <= 4 * SLOT + max(t.nbytes for t in node.checkpoint.catalog.tensors)
    assert sum(node.submitted) < total
    assert list(node.shm.iterdir()) == []


def test_cancel_stops_a_load_and_tells_the_ranks(node):
    session = node.session(1)
    _join_all(session, [None])
    held = session.next(0, [], 10.0)[0]  # handed and not released: the rank may still be copying them
    assert any(h.segment is not None for h in held)
    session.cancel("the daemon is stopping")
    with pytest.raises(SessionError, match="the daemon is stopping"):
        while True:
            session.next(0, [], 1.0)
    assert session.wait_ended(60) and session.holding
    # The ended session keeps what the rank holds, bytes unchanged, until it leaves.
    for h in [h for h in held if h.segment is not None]:
        assert _bytes(h, node.shm) == _truth(node.checkpoint, h.name, node.dir)
    assert list(node.shm.iterdir())
    session.leave(0)
    assert not session.holding and list(node.shm.iterdir()) == []


def test_a_rank_that_failed_fails_the_session_naming_it(node):
    """In-process: a rank leaving with an error is failed, not delivered."""
    session = node.session(2)
    _join_all(session, [None, None])
    results = [None]
    other = threading.Thread(target=lambda: results.__setitem__(0, _consume(session, 1, node.shm)))
    other.start()
    handles, _ = session.next(0, [], 5.0)
    assert handles
    session.leave(0, "DaemonError: shared-memory segment not found")
    other.join(120)
    assert len(results[0]) == len(node.checkpoint.catalog.tensors)  # the other rank got everything
    assert session.wait_ended(60) and session.state is SessionState.FAILED
    summary = session.summary()
    assert summary.ranks[0].status == "failed" and "segment not found" in summary.ranks[0].error
    assert summary.ranks[1].status == "done"
    assert "rank 0 failed: DaemonError" in summary.error
    assert list(node.shm.iterdir()) == []


def test_a_checking_thread_that_cannot_start_fails_the_session(node, monkeypatch):
    """No thread for the version checks (a pids limit, memory): the ranks get the error and the
    session ends, its segments given back; it does not stream for ever with nobody told."""

    class NoThreads(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(versions_module, "ThreadPoolExecutor", NoThreads)
    session = node.session(1, versions=ObjectVersions.of(node.checkpoint, Settings()))
    with pytest.raises(StreamerError, match=r"daemon error while streaming .*can't start new thread"):
        _join_all(session, [None])  # the join itself says so when the session failed first
        session.next(0, [], 5.0)
    assert session.wait_ended(60) and session.state is SessionState.FAILED and node.ended == [session]
    assert list(node.shm.iterdir()) == []


def test_a_newer_request_of_a_rank_answers_in_place_of_one_still_waiting(node):
    """A rank asks one request at a time: one still waiting when the next comes was given up by its
    client, and hands out nothing; nor does one whose connection closed (``gone``): what becomes
    ready stays for the request that will read it."""
    session = node.session(1)
    _join_all(session, [None])
    taken = _hold(session, 0, 1.0)
    got = [h.name for h in taken]
    held = {h.batch for h in taken if h.segment is not None}
    answers: list = []
    old = threading.Thread(target=lambda: answers.append(session.next(0, [], 60.0)))
    old.start()
    while not session.ranks[0].asking and old.is_alive():  # the old request waits
        threading.Event().wait(0.01)
    gone = threading.Event()
    gone.set()
    assert session.next(0, sorted(held), 0.0, gone) == ([], False)  # released; its connection closed: nothing taken
    old.join(30)
    assert not old.is_alive() and answers[0][1] is False  # it gave way at once (nothing was ready for it)
    got += [h.name for h in answers[0][0]]
    got += [name for name, _ in _consume(session, 0, node.shm)]  # what became ready meanwhile comes now
    assert got == [t.name for t in select(node.checkpoint.catalog.tensors, None)]
    assert session.wait_ended(60) and session.state is SessionState.DONE


@pytest.mark.parametrize(("world", "pins", "bound"), [(2, True, 3), (2, False, 0), (1, True, 0)])
def test_ranks_that_page_lock_get_a_ring_kept_to_the_slots_a_load_starts_with(node, world, pins, bound):
    """Several ranks that may page-lock the segments they copy from (CUDA ranks) register each
    once, so their session's ring is kept to the slots a load starts with (``first_ring_slots``: 3
    of this budget's 4), and their joins say how many; other ranks', and one such rank's alone,
    grows to what the budget holds. Rank 0 holding every batch shows the ring's size; every byte
    exact for every rank."""
    session = node.session(world)
    prefix = ["model.layers."]  # slot batches only: no oversized tensor
    _join_all(session, [prefix] * world, pins=pins)
    assert first_ring_slots(4 * SLOT, SLOT, SLOT) == 3  # no bound in flight: one slot
    assert [session.ring_slots(rank) for rank in range(world)] == [bound] * world
    taken = _hold(session, 0, 2.0)  # by rank 0
    got = [(h.name, _bytes(h, node.shm)) for h in taken]
    held = {h.batch for h in taken if h.segment is not None}
    segments = {h.segment for h in taken if h.segment is not None}
    assert len(segments) == len(held) == (bound or 4)
    session.next(0, sorted(held), 0.0)
    others: list = [None] * world
    threads = [
        threading.Thread(target=lambda r=r: others.__setitem__(r, _consume(session, r, node.shm))) for r in range(1, world)
    ]
    for t in threads:
        t.start()
    got += _consume(session, 0, node.shm)
    for t in threads:
        t.join(120)
    wanted = [t.name for t in select(node.checkpoint.catalog.tensors, prefix)]
    for rank_got in [got, *others[1:]]:
        assert [n for n, _ in rank_got] == wanted
        assert all(data == _truth(node.checkpoint, n, node.dir) for n, data in rank_got)
    assert session.wait_ended(60) and session.state is SessionState.DONE
    assert list(node.shm.iterdir()) == []


def test_a_refused_rank_fails_the_joining_ranks_at_once(node):
    """In-process: the ranks already waiting get the refusal, not the join timeout."""
    session = node.session(2)
    waiting, error = _rank_0_waits(session, node)
    session.refuse(SessionError("rank 1 of session 'key' was refused (SelectionError: x)"))
    waiting.join(10)
    assert not waiting.is_alive() and "rank 1 of session 'key' was refused" in str(error[0])
    assert session.state is SessionState.FAILED and node.ended == [session]


def test_a_rank_that_leaves_while_the_group_joins_fails_the_joining_ranks_at_once(node):
    """Its load would read for a group that cannot form: the waiting ranks hear why now, not at
    the join timeout, and nothing is read."""
    session = node.session(2)
    waiting, error = _rank_0_waits(session, node)
    with pytest.raises(SessionError, match="^rank 1 is not part of session 'key'$"):
        session.leave(1)  # never joined: refused, and the group still waits
    assert session.state is SessionState.JOINING and waiting.is_alive()
    session.leave(0, "the engine stopped")
    waiting.join(10)
    assert not waiting.is_alive() and type(error[0]) is SessionError
    assert str(error[0]) == (
        f"session 'key' for {node.checkpoint.uri.normalized}: rank 0 left before every rank joined (the engine stopped)"
    )
    assert session.state is SessionState.FAILED and node.ended == [session]
    assert node.submitted == [] and list(node.shm.iterdir()) == []
    session.leave(0)  # leaving again changes nothing


def _rank_0_waits(session: Session, node) -> tuple[threading.Thread, list[BaseException]]:
    """Rank 0 of two joined and waiting for rank 1 on a thread; what its join raises goes in the list."""
    error: list[BaseException] = []
    waiting = threading.Thread(target=lambda: _catch(error, session.join, 0, 2, node.checkpoint.catalog.tensors, None))
    waiting.start()
    while not session.ranks:
        threading.Event().wait(0.01)
    return waiting, error


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        out.append(exc)


def test_a_rank_that_received_everything_is_done_even_before_it_says_leave(node):
    """A finished session's summary never says "active": a rank handed and released everything
    whose leave had not arrived yet when the load ended is done (it was reported "active")."""
    session = node.session(2)
    _join_all(session, [None, None])
    got0: list = []
    rank0 = threading.Thread(target=lambda: got0.extend(_consume(session, 0, node.shm)))  # reads everything, leaves
    rank0.start()
    release: list[int] = []
    while True:  # rank 1 reads and releases everything, but does not leave
        handles, done = session.next(1, release, 5.0)
        release = sorted({h.batch for h in handles if h.segment is not None})
        if done:
            session.next(1, release, 0)
            break
    rank0.join(60)
    assert session.wait_ended(60) and session.state is SessionState.DONE
    assert {r: s.status for r, s in session.summary().ranks.items()} == {0: "done", 1: "done"}
    session.leave(1)  # its leave after the end changes nothing
    assert session.summary().ranks[1].status == "done"
    assert len(got0) == len(node.checkpoint.catalog.tensors)
    assert list(node.shm.iterdir()) == []
