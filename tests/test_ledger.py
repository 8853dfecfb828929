"""The rank ledger (streamer_service.daemon.ledger): how much of what is ready one ``/next`` reply
hands a rank, and when a batch a rank holds may be reused (real processes watched)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from streamer_client._protocol import Handle
from streamer_service.daemon.ledger import UNLEASED_SHARE, RankLedger, RankStatus
from streamer_service.daemon.process import ProcessWatch

SLOT = 1 << 20


def _batch(index: int, tensors: int) -> list[Handle]:
    size = SLOT // tensors
    return [Handle(index, f"seg-{index}", i * size, size, f"t{index}.{i}", "uint8", (size,), False) for i in range(tensors)]


def _published(tensors: int, count: int, *, ring: bool) -> tuple[RankLedger, object]:
    """A ledger with one rank and ``count`` batches of ``tensors`` tensors published to it: each in
    a ring slot of its own (``ring``: the ring waits for its release), or in an earlier load's
    resident copy (token ``None``: the copy owns the memory)."""
    ledger = RankLedger()
    batches = [_batch(i, tensors) for i in range(count)]
    names = frozenset(h.name for b in batches for h in b)
    state = ledger.add(0, names, count * SLOT, tensors * count, None, 0.0)
    for i, handles in enumerate(batches):
        ledger.publish(i, handles, object() if ring else None)
    return ledger, state


def _replies(ledger: RankLedger, state, tensors: int, max_bytes: int) -> list[list[int]]:
    """The batches of each reply, until the rank's queue is empty; every batch arrives whole."""
    replies = []
    while state.queue:
        per_batch = Counter(h.batch for h in ledger.take(state, 8192, max_bytes))
        assert set(per_batch.values()) == {tensors}
        replies.append(sorted(per_batch))
    return replies


def test_a_reply_holds_about_a_slot_of_ring_batches_and_whole_batches_only():
    ledger, state = _published(4, 4, ring=True)
    assert _replies(ledger, state, 4, SLOT) == [[0], [1], [2], [3]]
    assert state.to_hand_out == 0 and state.delivered_bytes == 4 * SLOT

    ledger, state = _published(4, 4, ring=True)
    assert _replies(ledger, state, 4, SLOT // 3) == [[0], [1], [2], [3]]  # past the bound: the batch stays whole


def test_batches_no_ring_waits_for_go_many_to_a_reply():
    count = 2 * UNLEASED_SHARE
    ledger, state = _published(2, count, ring=False)
    assert _replies(ledger, state, 2, SLOT) == [list(range(UNLEASED_SHARE)), list(range(UNLEASED_SHARE, count))]
    assert ledger.release(state, range(count)) == []  # no slot to give back to a ring


def test_a_rank_releases_only_batches_it_was_handed():
    """A release of a batch still queued for the rank (its bytes maybe unread) frees nothing: the
    slot would go back to the ring and be overwritten under a rank yet to read it."""
    ledger, state = _published(2, 2, ring=True)
    assert ledger.release(state, [0, 1]) == [] and state.outstanding == {0, 1}
    handed = ledger.take(state, 8192, SLOT)
    assert {h.batch for h in handed} == {0}
    assert len(ledger.release(state, [0, 1])) == 1 and state.outstanding == {1}  # batch 0's slot only
    ledger.take(state, 8192, SLOT)
    assert len(ledger.release(state, [1])) == 1 and state.outstanding == set()


def _holding(process) -> tuple[RankLedger, object, list[object]]:
    """A ledger whose one rank (its process watched by ``process``) was handed batch 0 of 3."""
    ledger = RankLedger()
    batches = [_batch(i, 1) for i in range(3)]
    state = ledger.add(0, frozenset(h.name for b in batches for h in b), 3 * SLOT, 3, process, 0.0)
    tokens = [object() for _ in batches]
    for i, handles in enumerate(batches):
        ledger.publish(i, handles, tokens[i])
    assert [h.batch for h in ledger.take(state, 8192, SLOT)] == [0]
    return ledger, state, tokens


@pytest.fixture
def child():
    """A live process to watch, and a way to end it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_silent_rank_whose_process_lives_is_fenced_and_keeps_what_it_was_handed(child):
    ledger, state, tokens = _holding(ProcessWatch.of(child.pid))
    [(_, why, freed)] = ledger.reclaim(100.0, 30.0)
    assert state.status is RankStatus.RECLAIMED and "fenced" in why
    assert freed == tokens[1:] and ledger.holding and ledger.held_tokens() == [tokens[0]]
    assert ledger.reclaim(200.0, 30.0) == []  # still alive: still held
    child.kill()
    child.wait()
    [(_, why, freed)] = ledger.reclaim(200.0, 30.0)
    assert freed == [tokens[0]] and "its process is gone" in why and not ledger.holding


def test_a_fenced_rank_gives_back_what_it_held_when_it_releases_or_leaves(child):
    ledger, state, tokens = _holding(ProcessWatch.of(child.pid))
    ledger.reclaim(100.0, 30.0)
    assert ledger.release(state, [0]) == [tokens[0]] and not ledger.holding
    ledger, state, tokens = _holding(ProcessWatch.of(child.pid))
    ledger.reclaim(100.0, 30.0)
    assert ledger.leave(state) == [tokens[0]] and not ledger.holding


def test_a_silent_rank_the_daemon_cannot_watch_loses_its_holds_at_the_timeout():
    ledger, state, tokens = _holding(None)
    [(_, _, freed)] = ledger.reclaim(100.0, 30.0)
    assert state.status is RankStatus.RECLAIMED and freed == tokens and not ledger.holding


def test_the_end_of_a_session_frees_what_was_not_handed_and_keeps_what_a_live_rank_holds(child):
    ledger, state, tokens = _holding(ProcessWatch.of(child.pid))
    assert ledger.end() == tokens[1:] and ledger.held_tokens() == [tokens[0]]
    child.kill()
    child.wait()
    [(_, why, freed)] = ledger.reclaim(0.0, 30.0)
    assert freed == [tokens[0]] and "its process is gone" in why
