"""The rank ledger's replies (streamer_service.daemon.ledger): how much of what is ready one
``/next`` reply hands a rank."""

from __future__ import annotations

from streamer_client.protocol import Handle
from streamer_service.daemon.ledger import UNLEASED_SHARE, RankLedger

SLOT = 1 << 20


def _batch(index: int, tensors: int) -> list[Handle]:
    size = SLOT // tensors
    return [Handle(index, f"seg-{index}", i * size, size, f"t{index}.{i}", "uint8", (size,), False) for i in range(tensors)]


def _replies(ledger: RankLedger, state, batches: int) -> list[list[int]]:
    replies = []
    while state.queue:
        replies.append(sorted({h.batch for h in ledger.take(state, 8192, SLOT)}))
    assert sum(len(r) for r in replies) == batches
    return replies


def test_a_reply_holds_about_a_slot_of_ring_batches_and_whole_batches_only():
    ledger = RankLedger()
    batches = [_batch(i, 4) for i in range(4)]
    state = ledger.add(0, frozenset(h.name for b in batches for h in b), 4 * SLOT, 16, None, 0.0)
    for i, handles in enumerate(batches):
        ledger.publish(i, handles, object())  # a ring slot each: the ring waits for its release
    assert _replies(ledger, state, 4) == [[0], [1], [2], [3]]
    assert state.to_hand_out == 0 and state.delivered_bytes == 4 * SLOT


def test_batches_no_ring_waits_for_go_many_to_a_reply():
    ledger = RankLedger()
    count = 2 * UNLEASED_SHARE
    batches = [_batch(i, 2) for i in range(count)]
    state = ledger.add(0, frozenset(h.name for b in batches for h in b), count * SLOT, 2 * count, None, 0.0)
    for i, handles in enumerate(batches):
        ledger.publish(i, handles, None)  # an earlier load's resident copy owns the memory
    replies = _replies(ledger, state, count)
    assert replies == [list(range(UNLEASED_SHARE)), list(range(UNLEASED_SHARE, count))]
    assert ledger.release(state, range(count)) == []  # no slot to give back to a ring
