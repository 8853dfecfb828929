"""The generation fence: the daemon bumps a segment's generation before it writes new bytes into
it, and a rank that finds the generation of a batch it read changed raises instead of yielding.

The faults are injected into the daemon's real generations table (a file in the shm dir, shared
memory like the segments): the test process writes a segment's entry while a rank holds a reply,
as a daemon that reused the segment would."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from daemon_harness import finish_failed, wait_until

from streamer_client import _protocol as protocol
from streamer_client._daemon import DaemonClient
from streamer_client._fence import Fence
from streamer_client._protocol import Handle, NextReply
from streamer_client.errors import SessionError
from streamer_service.checkpoint.header import TensorInfo
from streamer_service.checkpoint.plan import build_plan
from streamer_service.daemon.segment_pool import SegmentPool
from streamer_service.daemon.session_buffers import SessionBuffers, handle
from streamer_service.daemon.shm import SegmentStore, ShmBudget, sweep_stale_segments

SLOT = 1 << 20
_ENTRY = struct.Struct("<Q")


def _entries(table) -> dict[int, int]:
    """The entries of a generations table that hold a generation."""
    data = table.read_bytes()
    return {i: v for i, (v,) in enumerate(_ENTRY.iter_unpack(data)) if v}


def _bump_every_entry(table) -> None:
    """What a daemon that reused every segment would do: a new generation in every live entry."""
    with open(table, "r+b") as f:
        for entry, value in _entries(table).items():
            f.seek(entry * _ENTRY.size)
            f.write(_ENTRY.pack(value + 10**12))


def _tables(d) -> list:
    return sorted(d.shm_dir.glob("*.generations"))


def _paused_rank(d, sample, **env):
    """A rank of the whole sample that holds its first tensor (paused) once the daemon has read
    every byte, so every batch it will be handed was written and published already."""
    from test_daemon import _catalog

    names = [t.name for t in _catalog(sample).tensors]
    total = sum(t.nbytes for t in _catalog(sample).tensors)
    rank = d.start_rank(str(sample), 0, 1, sample, names, RANK_PAUSE_AFTER="0", **env)
    assert rank.stderr.readline().strip() == "paused", rank.stderr.read()
    wait_until(lambda: d.stats()["sessions"] and d.stats()["sessions"][0]["bytes_read"] >= total, 60, "every byte read")
    return rank, names


@pytest.fixture
def fenced_daemon(daemon):
    # Room for the whole sample in the ring, no tensor oversized: every batch is loaded while the
    # rank holds its first.
    return daemon({"STREAMER_SLOT_SIZE": "8MiB", "STREAMER_RANK_TIMEOUT_S": "60"}, "--shm-budget", "128MiB")


def test_an_owned_rank_whose_segment_was_given_new_bytes_raises_naming_the_tensor(sample, fenced_daemon):
    d = fenced_daemon
    rank, names = _paused_rank(d, sample)
    [table] = _tables(d)
    _bump_every_entry(table)
    rank.stdin.write("go\n")
    rank.stdin.flush()
    result = finish_failed(rank)
    error = result["error"]
    assert result["bad"] == []  # never a wrong tensor
    assert error["type"] == "SessionError" and error["key"] in names and error["key"] not in result["got"]
    assert result["got"] == names[: len(result["got"])] and len(result["got"]) < len(names)
    session = d.finished()[-1]
    assert f"session {session['id']}: tensor {error['key']!r} was not handed out" in error["message"]
    assert "shared-memory segment streamer-" in error["message"] and "was given new bytes" in error["message"]
    assert session["state"] == "failed"
    wait_until(lambda: not list(d.shm_dir.iterdir()), 10, "the segments and the table gone")


def test_a_borrowed_view_whose_segment_was_given_new_bytes_raises_borrowed_tensor_error(sample, fenced_daemon):
    d = fenced_daemon
    rank, names = _paused_rank(d, sample, RANK_BORROWED="1")
    [table] = _tables(d)
    _bump_every_entry(table)  # the view in the rank's hand is of a segment given new bytes
    rank.stdin.write("go\n")
    rank.stdin.flush()
    result = finish_failed(rank)
    error = result["error"]
    assert result["bad"] == []
    assert error["type"] == "BorrowedTensorError" and error["key"] in names
    assert "was given new bytes while this rank read it" in error["message"] and "streamer-" in error["message"]
    wait_until(lambda: not list(d.shm_dir.iterdir()), 10, "the segments and the table gone")


def test_a_recycled_slot_has_a_new_generation_before_the_load_writes_into_it(tmp_path):
    tmp_path = tmp_path / "segments"
    tmp_path.mkdir()
    store = SegmentStore(tmp_path)
    store.open()
    pool = SegmentPool(store, ShmBudget(SLOT), idle_s=0)  # room for one slot: the second batch reuses it
    buffers = SessionBuffers(pool, SLOT, None, lock=threading.Condition(), clock=time.monotonic)
    size = SLOT * 3 // 5  # a slot's worth: two batches of one tensor each
    tensors = [TensorInfo(f"t{i}", "U8", (size,), "f", 8 + i * size, size) for i in range(2)]
    plan = build_plan(tensors, SLOT)
    buffers.prepare(plan, "key")
    first, second = plan.batches
    table = tmp_path / store.generations.name
    fence = Fence(table, "s1")

    slot = buffers.acquire(first)
    held = handle(0, slot.segment, 0, tensors[0])
    assert held.entry >= 0 and _entries(table) == {held.entry: held.generation}
    fence.check([held])
    buffers.recycle(slot)  # every rank released it
    again = buffers.acquire(second)  # nothing has written into it yet
    assert again.segment is slot.segment
    assert _entries(table) == {held.entry: again.segment.generation} and again.segment.generation > held.generation
    with pytest.raises(
        SessionError, match=rf"session s1: tensor 't0' was not handed out: shared-memory segment {slot.segment.name} "
    ):
        fence.check([held])  # a rank still holding the last batch's handle
    fence.check([handle(1, again.segment, 0, tensors[1])])

    buffers.recycle(again)
    buffers.release()
    pool.close()
    store.close()
    fence.close()
    assert list(tmp_path.iterdir()) == []


def test_the_generations_table_lives_with_the_segments_and_a_dead_daemon_s_is_swept(tmp_path):
    tmp_path = tmp_path / "segments"
    tmp_path.mkdir()
    store = SegmentStore(tmp_path)
    store.open()
    table = tmp_path / store.generations.name
    assert not table.exists()  # an idle daemon's shm dir is empty
    a, b = store.create(4096), store.create(4096)
    assert table.exists() and table.stat().st_mode & 0o777 == 0o600
    assert store.leftovers() == sorted([a.path, b.path])  # the table is not a segment
    a.bump()
    assert _entries(table) == {a.entry: a.generation}
    a.close()
    assert table.exists()
    b.close()
    assert not table.exists()  # gone with the last segment
    c = store.create(4096)
    c.bump()
    assert c.generation > a.generation  # the counter goes on in the table made again
    c.close()
    store.close()
    assert list(tmp_path.iterdir()) == []

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    pid = int(gone.stdout)
    for name in (f"streamer-{pid}-abcd-1", f"streamer-{pid}-abcd.generations"):
        (tmp_path / name).write_bytes(b"x")
    assert sorted(sweep_stale_segments(tmp_path)) == [f"streamer-{pid}-abcd-1", f"streamer-{pid}-abcd.generations"]
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_does_not_ask_for_the_fence_gets_the_old_handles(sample, daemon):
    """An older client reads 8-field handles and no table: the daemon serves it that form."""
    d = daemon()
    for fence in (False, True):
        client = DaemonClient(d.socket)
        body = {"uri": str(sample), "session": f"old-{fence}", "rank": 0, "world_size": 1}
        joined = client.call(protocol.JOIN_PATH, {**body, "fence": True} if fence else body)
        assert (joined["generations"] is not None) == fence
        path = protocol.rank_path(joined["session_id"], 0, "next")
        raw = client.call(path, {"release": [], "wait_s": 5.0, **({"fence": True} if fence else {})})
        assert raw["handles"] and {len(h) for h in raw["handles"]} == ({10} if fence else {8})
        handles = NextReply.from_wire(raw).handles
        assert all(h.entry >= 0 and h.generation > 0 for h in handles if h.segment is not None) == fence
        client.call(protocol.rank_path(joined["session_id"], 0, "leave"), protocol.LeaveRequest().to_wire())
        client.close()


def test_handles_in_the_old_form_still_parse():
    old = json.loads(json.dumps([3, "streamer-1-ab-2", 64, 12, "w", "BF16", [2, 3], False]))
    assert Handle.from_wire(old) == Handle(3, "streamer-1-ab-2", 64, 12, "w", "BF16", (2, 3), False, -1, 0)
    fenced = Handle(3, "streamer-1-ab-2", 64, 12, "w", "BF16", (2, 3), False, 7, 42)
    assert Handle.from_wire(json.loads(json.dumps(fenced.to_wire()))) == fenced
    assert fenced.to_wire(fenced=False) == old


def test_a_page_locked_batch_whose_segment_changed_before_its_copies_landed_raises_before_the_iterator_ends(sample, daemon):
    """The page-locked path yields tensors before their copies complete; the check runs at their
    completion (LateCopier: the device path's interface over CPU clones, completing at the second
    poll), and raises before the iterator ends and before the rank leaves."""
    from test_cuda import FakeCudart
    from test_segments import LateCopier

    from streamer_client._pinning import HostPinner
    from streamer_client._receiver import Receiver
    from streamer_client._segments import segment_maps

    d = daemon({"STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "4MiB")
    client = DaemonClient(d.socket)
    joined = client.call(protocol.JOIN_PATH, {"uri": str(sample), "session": "pinned", "rank": 0, "world_size": 1, "fence": True})
    segment_maps(d.shm_dir)._pinner = HostPinner(FakeCudart())
    fence = Fence(d.shm_dir / joined["generations"], joined["session_id"])
    receiver = Receiver(client, d.shm_dir, joined["session_id"], 0, torch.device("cpu"), False, fence=fence)
    receiver._copier = LateCopier()
    tensors = receiver.run()
    first, _ = next(tensors)  # yielded, its batch's copies not landed yet
    _bump_every_entry(d.shm_dir / joined["generations"])
    got = [first]
    with pytest.raises(SessionError, match=rf"session {joined['session_id']}: tensor '[^']+' was not handed out") as raised:
        got += [name for name, _ in tensors]
    assert raised.value.key == first  # the first batch's first tensor: checked once its copies landed
    assert d.finished()[-1]["state"] == "failed"
