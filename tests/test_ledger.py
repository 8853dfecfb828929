"""The rank ledger's replies (streamer_service.daemon.ledger): how much of what is ready one
``/next`` reply hands a rank."""

from __future__ import annotations

from collections import Counter

from streamer_client.protocol import Handle
from streamer_service.daemon.ledger import UNLEASED_SHARE, RankLedger

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
