"""CPU ranks that keep the daemon's segments (``STREAMER_CPU_TENSORS=mapped``): real daemon, real ranks.

Each rank's owned tensors lie over a copy-on-write mapping of a segment the daemon handed over:
bytes equal to the checkpoint's, in a mapping of an unlinked file of the shm dir (nothing copied),
private to the rank once it writes, and never rewritten by the daemon's later loads, although the
daemon's pool makes and reuses segments for them. Where any rank cannot keep them (borrowed views,
the default setting, a retention budget) the ranks copy as before.
"""

from __future__ import annotations

import pytest
from daemon_harness import Keeper

from streamer_service.sample import build_sample


@pytest.fixture
def keepers():
    started: list[Keeper] = []

    def start(*args, **kwargs) -> Keeper:
        k = Keeper(*args, **kwargs)
        started.append(k)
        return k

    yield start
    for k in started:
        if k.proc.poll() is None:
            k.proc.kill()
            k.proc.wait()


# Slots of 1 MiB within a 4 MiB budget: a 12 MB checkpoint takes a dozen batches through a ring of
# at most four slots, so the ring makes new slots in place of those handed over.
SMALL_RING = {"STREAMER_SLOT_SIZE": "1MiB", "STREAMER_SHM_BUDGET": "4MiB"}


def test_replicated_cpu_ranks_keep_handed_over_segments_which_no_later_load_rewrites(daemon, sample, tmp_path, keepers):
    # The pool on (idle segments kept and reused between loads): a later load must not reuse a
    # segment these ranks keep.
    d = daemon({"STREAMER_CPU_TENSORS": "mapped", "STREAMER_SEGMENT_IDLE_S": "60", **SMALL_RING})
    ranks = [keepers(d, sample, r, 2) for r in range(2)]
    loaded = [k.answer() for k in ranks]
    assert [r["differ"] for r in loaded] == [[], []]
    sized = loaded[0]["sized"]
    assert sized > 12 and loaded[0]["loaded"] == loaded[1]["loaded"]
    # Every tensor with bytes lies in a mapping of a segment the daemon has unlinked: nothing copied.
    assert [k.answer("where") for k in ranks] == [{"in_unlinked_segments": sized}] * 2
    summary = d.finished(1)[-1]
    assert summary["state"] == "done"

    # A write stays in the rank that made it.
    name = "model.embed_tokens.weight"
    assert ranks[0].answer(f"write {name}") == {"written": name, "sevens": True}
    assert ranks[1].answer("check") == {"differ": []}

    # Two more loads through the same daemon, of another checkpoint by a borrowing rank (segments
    # not handed over: ring slots the pool keeps, and the second load reuses those the first left
    # idle), leave the kept tensors as they were.
    other = tmp_path / "other"
    build_sample(other, size_mb=12, seed=1)
    reused = d.stats()["segments_reused"]
    for _ in range(2):
        borrower = keepers(d, other, 0, 1, borrowed=True)
        assert borrower.answer() == {"loaded": loaded[0]["loaded"], "differ": [], "sized": sized}
        borrower.close()
    assert d.stats()["segments_reused"] > reused
    assert [k.answer("check") for k in ranks] == [{"differ": []}] * 2
    for k in ranks:
        k.close()


@pytest.mark.parametrize(
    ("env", "borrowed"),
    [
        ({}, False),  # the default: copied
        ({"STREAMER_CPU_TENSORS": "mapped"}, True),  # a borrowed rank's views end with its batch
        ({"STREAMER_CPU_TENSORS": "mapped", "STREAMER_RETENTION_BUDGET": "64MiB"}, False),  # the load stays resident
    ],
    ids=["copied-by-default", "borrowed", "retained"],
)
def test_segments_are_handed_over_only_where_every_rank_keeps_them_and_nothing_is_retained(
    daemon, sample, keepers, env, borrowed
):
    d = daemon({**SMALL_RING, **env})
    ranks = [keepers(d, sample, r, 2, borrowed=borrowed and r == 1) for r in range(2)]
    assert [k.answer()["differ"] for k in ranks] == [[], []]
    assert [k.answer("where") for k in ranks] == [{"in_unlinked_segments": 0}] * 2
    assert d.finished(1)[-1]["state"] == "done"
    for k in ranks:
        k.close()
