"""Warm restart: checkpoint bytes kept in shared memory serve the next load and rejoining ranks.

Storage reads are counted at the storage side (the counting proxy's log of range GETs), not by
the daemon's own counters.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
from daemon_harness import DaemonProcess, finish, finish_failed, segment_files
from prometheus_client.parser import text_string_to_metric_families

from streamer_client import _protocol as protocol
from streamer_service.checkpoint.catalog import build_catalog
from streamer_service.checkpoint.plan import BatchKind, build_plan
from streamer_service.daemon.resident import ResidentStore
from streamer_service.daemon.shm import SegmentStore
from streamer_service.sample import build_sample, rank_selection
from streamer_service.settings import Settings
from streamer_service.sizing import first_ring_slots
from streamer_service.storage import open_storage
from streamer_service.uri import parse_uri

WORLD = 2


def _names(src: Path) -> list[str]:
    return [t.name for t in build_catalog(open_storage(parse_uri(str(src)), Settings())).tensors]


def _nbytes(src: Path, names) -> int:
    catalog = build_catalog(open_storage(parse_uri(str(src)), Settings()))
    return sum(catalog[n].nbytes for n in set(names))


def _upload(backend, src: Path, prefix: str = "ckpt") -> str:
    backend.put_tree(prefix, {p.name: p.read_bytes() for p in src.iterdir()})
    return backend.uri(prefix)


def _tensor_bytes_served(backend) -> int:
    """Bytes of ``*.safetensors`` objects the storage answered with, from the proxy's Range log."""
    total = 0
    for r in backend.proxy.requests:
        if r.method == "GET" and r.path.endswith(".safetensors"):
            assert r.range, f"a whole-object read of {r.path}"
            a, b = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", r.range).groups())
            total += b - a + 1
    return total


def _load(d: DaemonProcess, uri: str, truth: Path, selections, launch: str, **env) -> list[dict]:
    """Run one load's ranks to the end, and wait until the daemon has filed its session."""
    ended = len(d.stats()["finished"])
    ranks = [
        d.start_rank(uri, r, len(selections), truth, selections[r], STREAMER_LAUNCH_ID=launch, **env)
        for r in range(len(selections))
    ]
    results = [finish(p) for p in ranks]
    for r, result in enumerate(results):
        assert result["bad"] == [], result["bad"]
        assert sorted(result["got"]) == sorted(selections[r])
    d.finished(ended + 1)
    return results


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120) -> None:
    """Read the rank's stderr until a line contains ``text`` (the rank keeps running)."""
    found = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            if text in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        raise AssertionError(f"the rank did not print {text!r} (exit {proc.poll()})")


def _selections(src: Path) -> list[list[str]]:
    names = _names(src)
    return [rank_selection(names, r, WORLD) for r in range(WORLD)]


# --------------------------------------------------------------------------- warm reload


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_second_load_is_served_from_memory_with_no_storage_read(backend, sample, daemon):
    uri = _upload(backend, sample)
    selections = _selections(sample)
    union = _nbytes(sample, [n for s in selections for n in s])
    d = daemon(backend.env, "--shm-budget", "8MiB", "--retention-budget", "64MiB")

    backend.proxy.reset()
    _load(d, uri, sample, selections, launch="first")
    assert union <= _tensor_bytes_served(backend) <= union * 1.001  # cold: each byte once (+ headers)
    resident = d.stats()
    assert resident["resident_bytes"] >= union
    segments = sorted(p.name for p in segment_files(d.shm_dir))
    assert segments  # the copy outlives the session

    backend.proxy.reset()
    _load(d, uri, sample, selections, launch="second")  # a new launch: a new session key
    assert _tensor_bytes_served(backend) == 0  # warm: nothing read from storage
    # What the warm load asked of the storage: one listing that proves the copy is current.
    assert [r.method for r in backend.proxy.requests] == ["GET"]
    assert backend.proxy.requests[0].range is None and not backend.proxy.requests[0].path.endswith(".safetensors")
    last = d.finished()[-1]
    assert (last["state"], last["bytes_read"], last["bytes_from_memory"]) == ("done", 0, union)
    stats = d.stats()
    assert stats["resident_bytes_served"] == union
    with d.client() as c:
        metrics = {s.name: s.value for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples}
    assert metrics["streamer_resident_served_bytes_total"] == union
    assert metrics["streamer_resident_bytes"] == stats["resident_bytes"]
    assert sorted(p.name for p in segment_files(d.shm_dir)) == segments  # served from the same segments
    assert stats["shm_in_use"] == 0  # ring budget untouched: the retention budget holds the copy

    d.stop()
    assert list(d.shm_dir.iterdir()) == []  # a stopping daemon takes its copies with it


def test_a_load_larger_than_the_retention_budget_streams_through_the_ring(sample, daemon):
    names = _names(sample)
    d = daemon({}, "--shm-budget", "8MiB", "--retention-budget", "4MiB")
    _load(d, str(sample), sample, [names], launch="first")
    stats = d.stats()
    assert stats["resident_bytes"] == 0 and stats["resident_checkpoints"] == []
    assert list(d.shm_dir.iterdir()) == []
    _load(d, str(sample), sample, [names], launch="second")
    assert d.finished()[-1]["bytes_read"] == _nbytes(sample, names)


def test_a_retained_load_keeps_the_ring_made_at_start_and_the_daemon_makes_it_again(sample, daemon):
    """With a retention budget the daemon still prepares its standing ring at start; a retained load
    streams its first slot batches into those segments, which stay resident, and the daemon makes
    the ring again once the session ends."""
    from daemon_harness import wait_until

    names = _names(sample)
    d = daemon({"STREAMER_SEGMENT_IDLE_S": "30", "STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "8MiB",
               "--retention-budget", "64MiB")  # fmt: skip

    def settled(c) -> dict:
        return wait_until(lambda: (r := c.get("/readyz").json()) and not r["segments_preparing"] and r, what="segments made")

    with d.client() as c:
        prepared = settled(c)["segments_prepared"]
    assert prepared == 8  # the bytes in flight (the whole 8 MiB budget) in 1 MiB slots
    standing = {p.name for p in segment_files(d.shm_dir)}
    _load(d, str(sample), sample, [names], launch="first")
    with d.client() as c:
        again = settled(c)["segments_prepared"] - prepared  # made after the session, for the ring
    catalog = build_catalog(open_storage(parse_uri(str(sample)), Settings()))
    slot_batches = sum(b.kind is BatchKind.SLOT for b in build_plan(list(catalog.tensors), 2**20).batches if b.ranges)
    assert slot_batches >= 8  # every standing segment was taken, so none of them is idle now
    stats = d.stats()
    files = {p.name: p.stat().st_size for p in segment_files(d.shm_dir)}
    kept = standing & set(files)  # the standing segments still there: resident now
    assert again == len(kept) == 8 and stats["segments_idle"] == 8 and stats["shm_in_use"] == 8 * 2**20
    assert stats["resident_bytes"] == sum(files.values()) - 8 * 2**20 and all(files[n] == 2**20 for n in kept)
    _load(d, str(sample), sample, [names], launch="second")
    assert d.finished()[-1]["bytes_read"] == 0  # served from the kept segments, standing ones included


def test_least_recently_used_checkpoint_is_evicted(tmp_path, sample, daemon):
    other = tmp_path / "other"
    build_sample(other, size_mb=12, seed=1)
    names = _names(sample)
    size = _nbytes(sample, names)
    # Room for one copy (plus slack for the per-batch segment rounding), not two.
    d = daemon({}, "--shm-budget", "8MiB", "--retention-budget", str(size + size // 2))
    _load(d, str(sample), sample, [names], launch="a")
    _load(d, str(other), other, [_names(other)], launch="b")
    stats = d.stats()
    assert [c["uri"] for c in stats["resident_checkpoints"]] == [str(other)]
    assert stats["resident_evictions"] == 1
    _load(d, str(sample), sample, [names], launch="c")  # evicted: read again
    assert d.finished()[-1]["bytes_read"] == size
    assert [c["uri"] for c in d.stats()["resident_checkpoints"]] == [str(sample)]


# --------------------------------------------------------------------------- invalidation


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
def test_a_changed_object_drops_the_copy_and_fails_naming_the_key(backend, sample, tmp_path, daemon):
    uri = _upload(backend, sample)
    names = _names(sample)
    d = daemon(backend.env, "--shm-budget", "8MiB", "--retention-budget", "64MiB")
    _load(d, uri, sample, [names], launch="first")
    assert d.stats()["resident_bytes"] > 0

    changed = tmp_path / "changed"
    build_sample(changed, size_mb=12, seed=7)  # same layout, other bytes
    shard = sorted(p.name for p in changed.glob("*.safetensors"))[0]
    backend.put(f"ckpt/{shard}", (changed / shard).read_bytes())

    backend.proxy.reset()
    failed = finish_failed(d.start_rank(uri, 0, 1, sample, names, STREAMER_LAUNCH_ID="second"))
    assert failed["got"] == []  # nothing delivered
    error = failed["error"]
    assert (error["type"], error["key"], error["uri"]) == ("ObjectChangedError", shard, f"{uri}/{shard}")
    assert error["message"].startswith(f"{uri}/{shard} changed since the metadata of {uri} was pulled")
    assert "TRTLLM_OBJECT_STORAGE_FORCE_PULL=1" in error["message"]
    assert _tensor_bytes_served(backend) == 0  # nothing mixed: not one byte of the new object read
    stats = d.stats()
    assert stats["resident_bytes"] == 0 and stats["resident_checkpoints"] == []
    assert list(d.shm_dir.iterdir()) == []
    assert d.healthy()

    # A forced re-pull (once for the launch) loads the new version, byte-exact.
    for p in changed.iterdir():
        backend.put(f"ckpt/{p.name}", p.read_bytes())
    backend.proxy.reset()
    _load(d, uri, changed, [names], launch="third", TRTLLM_OBJECT_STORAGE_FORCE_PULL="1")
    size = _nbytes(changed, names)
    assert size <= _tensor_bytes_served(backend) <= size * 1.001  # headers read again, then the data


def test_force_pull_drops_the_resident_copy(sample, daemon):
    names = _names(sample)
    size = _nbytes(sample, names)
    d = daemon({}, "--shm-budget", "8MiB", "--retention-budget", "64MiB")
    _load(d, str(sample), sample, [names], launch="first")
    before = sorted(p.name for p in segment_files(d.shm_dir))
    _load(d, str(sample), sample, [names], launch="forced", TRTLLM_OBJECT_STORAGE_FORCE_PULL="1")
    assert d.finished()[-1]["bytes_read"] == size  # the re-pulled generation is read again
    after = sorted(p.name for p in segment_files(d.shm_dir))
    assert after and not set(after) & set(before)  # the old copy's segments are gone
    assert d.stats()["resident_bytes"] == sum(p.stat().st_size for p in segment_files(d.shm_dir))
    # The same launch again: its pull is done, the new copy serves it.
    _load(d, str(sample), sample, [names], launch="forced", TRTLLM_OBJECT_STORAGE_FORCE_PULL="1")
    assert d.finished()[-1]["bytes_read"] == 0


# --------------------------------------------------------------------------- rejoin


@pytest.mark.parametrize("backend", ["s3"], indirect=True)
@pytest.mark.parametrize("retention", ["64MiB", "0"])
def test_a_killed_rank_rejoins_and_refetches_only_what_is_not_resident(backend, sample, daemon, retention):
    uri = _upload(backend, sample)
    selections = _selections(sample)
    union = _nbytes(sample, [n for s in selections for n in s])
    mine = _nbytes(sample, selections[1])
    d = daemon(backend.env, "--shm-budget", "8MiB", "--retention-budget", retention)
    backend.proxy.reset()

    rank0 = d.start_rank(uri, 0, WORLD, sample, selections[0], STREAMER_LAUNCH_ID="L")
    rank1 = d.start_rank(uri, 1, WORLD, sample, selections[1], STREAMER_LAUNCH_ID="L", RANK_STALL_AFTER="3")
    _wait_for_line(rank1, "stalled")
    rank1.send_signal(signal.SIGKILL)  # dies holding leases; the daemon reclaims it after 2 s
    rank1.wait()
    assert finish(rank0)["bad"] == []
    first = d.finished(1)[-1]
    assert first["state"] == "done" and first["ranks"]["1"]["status"] == "reclaimed"
    assert union <= _tensor_bytes_served(backend) <= union * 1.001

    # The restarted rank 1 (same launch, so the same session key) comes back alone.
    backend.proxy.reset()
    again = finish(d.start_rank(uri, 1, WORLD, sample, selections[1], STREAMER_LAUNCH_ID="L"))
    assert again["bad"] == [] and sorted(again["got"]) == sorted(selections[1])
    rejoin = d.finished(2)[-1]
    assert rejoin["rejoin_of"] == f"L:{uri}" and rejoin["state"] == "done"
    if retention == "0":  # nothing kept: its whole selection again, and only that
        assert (rejoin["bytes_read"], rejoin["bytes_from_memory"]) == (mine, 0)
        assert _tensor_bytes_served(backend) == mine
    else:
        assert (rejoin["bytes_read"], rejoin["bytes_from_memory"]) == (0, mine)
        assert _tensor_bytes_served(backend) == 0

    # Caught up, rank 1 belongs to its group again: the next load of the launch waits for both.
    _load(d, uri, sample, selections, launch="L")
    assert d.finished()[-1]["rejoin_of"] is None


def test_a_rank_rejoining_while_the_others_still_load_gets_what_is_resident(sample, daemon):
    selections = _selections(sample)
    mine = _nbytes(sample, selections[1])
    # Rank 0 consumes slowly (a 2 MiB batch of a few tensors per poll, well within the rank timeout).
    d = daemon({"STREAMER_RANK_TIMEOUT_S": "5"}, "--shm-budget", "8MiB", "--retention-budget", "64MiB")
    rank0 = d.start_rank(str(sample), 0, WORLD, sample, selections[0], STREAMER_LAUNCH_ID="L", RANK_SLOW_S="0.2")
    rank1 = d.start_rank(str(sample), 1, WORLD, sample, selections[1], STREAMER_LAUNCH_ID="L", RANK_STALL_AFTER="1")
    _wait_for_line(rank1, "stalled")
    rank1.send_signal(signal.SIGKILL)
    rank1.wait()
    # Joining again at once: the daemon waits until it has reclaimed the dead rank 1, then serves it.
    again = finish(d.start_rank(str(sample), 1, WORLD, sample, selections[1], STREAMER_LAUNCH_ID="L"))
    assert again["bad"] == []
    assert finish(rank0)["bad"] == []
    rejoin, first = d.finished(2)  # in the order they ended: the rejoin while rank 0 still loaded
    assert rejoin["rejoin_of"] == f"L:{sample}" and first["rejoin_of"] is None
    assert first["ranks"]["1"]["status"] == "reclaimed" and first["ranks"]["0"]["status"] == "done"
    assert rejoin["bytes_read"] + rejoin["bytes_from_memory"] == mine
    assert rejoin["bytes_from_memory"] > 0


def test_a_second_live_process_with_the_same_rank_is_refused(sample, daemon):
    names = _names(sample)
    # The first keeps polling (a batch of a few tensors every second or so), so it is never silent
    # for STREAMER_RANK_TIMEOUT_S; the second waits that long for a reclaim, then is refused.
    d = daemon({"STREAMER_RANK_TIMEOUT_S": "5"}, "--shm-budget", "8MiB")
    first = d.start_rank(str(sample), 0, 1, sample, names, STREAMER_LAUNCH_ID="L", RANK_SLOW_S="0.2")
    _wait_for_line(first, "got")
    error = finish_failed(d.start_rank(str(sample), 0, 1, sample, names, STREAMER_LAUNCH_ID="L"))["error"]
    assert error["type"] == "SessionError"
    assert error["message"].startswith(f"rank 0 is still loading in session 'L:{sample}'")
    assert "two processes cannot be the same rank" in error["message"]
    assert first.poll() is None  # unharmed
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert d.healthy()


# --------------------------------------------------------------------------- the store itself


def test_store_accounting_pins_and_lru(tmp_path):
    store = SegmentStore(tmp_path)
    resident = ResidentStore(limit=3 * 4096)
    a = resident.pin("a", "g1")
    assert resident.claim(a, 2 * 4096)
    seg = store.create(2 * 4096)
    resident.add(a, seg, [("x", 0), ("y", 4096)])
    resident.settle(0)
    resident.unpin(a)
    b = resident.pin("b", "g1")
    assert not resident.claim(b, 4 * 4096)  # more than the whole budget
    assert resident.claim(b, 2 * 4096)  # evicts a, the least recently used and unpinned
    assert resident.stats().resident_evictions == 1 and not seg.path.exists()
    resident.settle(2 * 4096)  # b's load failed before filling anything
    resident.unpin(b)
    assert resident.used == 0 and resident.stats().resident_checkpoints == ()

    c = resident.pin("c", "g1")
    assert resident.claim(c, 4096)
    kept = store.create(4096)
    resident.add(c, kept, [("z", 0)])
    again = resident.pin("c", "g2")  # another generation while the first is still in use
    assert c.dropped and kept.path.exists()  # pinned: its segment stays until released
    resident.unpin(c)
    assert not kept.path.exists() and resident.used == 0
    resident.unpin(again)
    assert store.leftovers() == []


def test_the_store_tells_whether_a_generation_holds_every_tensor_asked_for(tmp_path):
    store = SegmentStore(tmp_path)
    resident = ResidentStore(limit=2 * 4096)
    assert not resident.holds("a", "g1", [])  # no copy at all
    a = resident.pin("a", "g1")
    assert resident.claim(a, 2 * 4096)
    resident.add(a, store.create(2 * 4096), [("x", 0), ("y", 4096)])
    resident.settle(0)
    resident.unpin(a)
    assert resident.holds("a", "g1", ["x"]) and resident.holds("a", "g1", ["y", "x"])
    assert not resident.holds("a", "g1", ["x", "w"])  # one tensor not kept
    assert not resident.holds("a", "g2", ["x"])  # another generation
    assert not resident.holds("b", "g1", ["x"])  # another checkpoint
    assert resident.stats().resident_bytes == 2 * 4096  # asking pinned and dropped nothing
    resident.drop(a, "a test")
    assert not resident.holds("a", "g1", ["x"])
    assert store.leftovers() == []


def _joined(d: DaemonProcess, uri: str, select=None, *, pins: bool = False, world: int = 1) -> protocol.JoinReply:
    """What rank 0's join is told, its ``world`` ranks joining at once (they then leave at once)."""
    key = uuid.uuid4().hex
    replies: list = [None] * world

    def join(rank: int) -> None:
        body = protocol.JoinRequest(uri=uri, session=key, rank=rank, world_size=world, select=select, launch_id="hint", pins=pins)
        with d.client() as c:
            reply = replies[rank] = protocol.JoinReply.from_wire(c.post(protocol.JOIN_PATH, json=body.to_wire()).json())
            c.post(protocol.rank_path(reply.session_id, rank, "leave"), json=protocol.LeaveRequest().to_wire()).raise_for_status()

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len({r.ring_slots for r in replies}) == 1  # every rank is told the same
    return replies[0]


def test_a_join_is_told_whether_its_bytes_are_in_memory(sample, daemon):
    names = _names(sample)
    d = daemon({}, "--shm-budget", "8MiB", "--retention-budget", "64MiB")
    _load(d, str(sample), sample, [names[: len(names) // 2]], launch="hint")
    assert _joined(d, str(sample), select=names[: len(names) // 4]).from_memory  # kept by that load
    # Half of it is not: told as the load starts, whatever it then streams before the rank leaves.
    assert not _joined(d, str(sample)).from_memory
    _load(d, str(sample), sample, [names], launch="hint")
    assert _joined(d, str(sample)).from_memory
    assert d.healthy()


def test_joins_that_may_page_lock_are_told_their_ring_of_recycled_slots_unless_the_load_may_be_kept(sample, daemon):
    """Two ranks that may page-lock what they copy from get a ring kept to the slots a load starts
    with (2 MiB slots of an 8 MiB budget at 100 Gbit/s: all 4), and their joins say so; one such
    rank alone, ranks that do not, and a daemon that retains loads (kept segments are new memory)
    are told 0."""
    streaming = daemon({}, "--shm-budget", "8MiB")
    assert _joined(streaming, str(sample), pins=True, world=2).ring_slots == first_ring_slots(8 << 20, 2 << 20, 8 << 20) == 4
    assert _joined(streaming, str(sample), pins=True).ring_slots == 0
    assert _joined(streaming, str(sample), world=2).ring_slots == 0
    assert streaming.healthy()
    streaming.stop()  # the next one serves on the same socket
    retaining = daemon({}, "--shm-budget", "8MiB", "--retention-budget", "64MiB")
    assert _joined(retaining, str(sample), pins=True, world=2).ring_slots == 0
    assert retaining.healthy()


def test_a_claim_evicts_only_what_makes_room_and_extra_bytes_evict_nothing(tmp_path):
    store = SegmentStore(tmp_path)
    resident = ResidentStore(limit=4 * 4096)

    def kept(uri: str, pages: int, *, pinned: bool = False):
        copy = resident.pin(uri, "g")
        assert resident.claim(copy, pages * 4096) == pages * 4096
        resident.add(copy, store.create(pages * 4096), [("t", 0)])
        resident.settle(0)
        if not pinned:
            resident.unpin(copy)
        return copy

    serving = kept("serving", 2, pinned=True)
    kept("idle", 1)
    new = resident.pin("new", "g")
    assert resident.claim(new, 3 * 4096) == 0  # evicting the unpinned copy would not make room
    assert resident.evictions == 0 and resident.used == 3 * 4096
    assert resident.claim(new, 4096, extra=4096) == 4096  # the extra page would evict "idle": not taken
    assert resident.evictions == 0 and resident.used == 4 * 4096
    resident.settle(4096)
    assert resident.claim(new, 2 * 4096, extra=4096) == 2 * 4096  # evicts "idle" for the 2 pages only
    assert resident.evictions == 1 and resident.used == 4 * 4096
    resident.settle(2 * 4096)
    assert resident.claim(new, 4096, extra=4096) == 2 * 4096  # room for both, nothing to evict
    resident.settle(2 * 4096)
    resident.unpin(new)
    resident.unpin(serving)
    resident.close()
    assert store.leftovers() == []
