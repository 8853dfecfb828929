"""A rank maps (and page-locks) each daemon segment once per process, and never a stale one.

Real segment files in shared memory, a real daemon for the reload; CUDA registration through the
fake runtime of tests/test_cuda.py (the GPU tests run the real one: tests/test_cuda_daemon.py).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import ground_truth
from daemon_harness import DaemonProcess, wait_until
from smaps import resident_bytes
from test_cuda import FakeCudart

import streamer_client
from streamer_client import _delivery as delivery
from streamer_client._daemon import DaemonClient
from streamer_client._dtypes import torch_layout
from streamer_client._fence import Fence
from streamer_client._host_memory import anonymous
from streamer_client._pinning import HostPinner
from streamer_client._protocol import Handle
from streamer_client._receiver import Receiver
from streamer_client._segments import POPULATE_PIECE, SegmentMaps, segment_maps


@pytest.fixture
def shm_dir():
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="segments-test-", dir=parent) as d:
        yield Path(d)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _mapped_paths() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def _maps(shm_dir: Path, fake: FakeCudart, **kw) -> SegmentMaps:
    return SegmentMaps(shm_dir, pinner=HostPinner(fake), **kw)


def test_a_segment_is_mapped_and_pinned_once_across_loads(shm_dir):
    data = os.urandom(3 * 4096)
    _write(shm_dir / "streamer-1-aa-1", data)
    fake = FakeCudart()
    maps = _maps(shm_dir, fake)
    for _ in range(3):
        load = maps.load(populate=False)
        load.prepare(["streamer-1-aa-1"], None)
        assert load.pinned("streamer-1-aa-1", None)
        assert load.array("streamer-1-aa-1")[4096:].tobytes() == data[4096:]
        load.close()
    assert (maps.stats.mapped, maps.stats.reused, maps.stats.pinned) == (1, 2, 1)
    assert [c[0] for c in fake.calls] == ["register"]
    maps.close()
    assert [c[0] for c in fake.calls] == ["register", "unregister"] and not fake.registered


class _ResidencyCudart(FakeCudart):
    """Records how much of each range was already mapped when it was registered."""

    def __init__(self) -> None:
        super().__init__()
        self.resident: list[int] = []

    def host_register(self, address: int, nbytes: int, flags: int) -> int:
        self.resident.append(resident_bytes(address))
        return super().host_register(address, nbytes, flags)


def test_a_segments_pages_are_mapped_before_its_registration(shm_dir):
    """Registration then locks pages already mapped instead of faulting them in one by one."""
    nbytes = 4 * POPULATE_PIECE + 4096  # several pieces and a short last one
    data = os.urandom(nbytes)
    _write(shm_dir / "streamer-1-aa-9", data)
    fake = _ResidencyCudart()
    maps = _maps(shm_dir, fake)
    load = maps.load(populate=False)
    assert resident_bytes(load.segment("streamer-1-aa-9").address) == 0  # mapped, nothing touched yet
    assert load.pinned("streamer-1-aa-9", None)
    assert fake.resident == [nbytes]
    assert load.array("streamer-1-aa-9").tobytes() == data
    load.close()
    maps.close()


def test_a_segment_replaced_under_its_name_is_never_mistaken_for_the_old_one(shm_dir):
    path = shm_dir / "streamer-1-aa-2"
    old, new = os.urandom(8192), os.urandom(8192)
    _write(path, old)
    fake = FakeCudart()
    maps = _maps(shm_dir, fake)
    load = maps.load(populate=False)
    assert load.array(path.name).tobytes() == old and load.pinned(path.name, None)
    load.close()
    path.unlink()
    _write(path, new)  # same name and size, another file
    load = maps.load(populate=False)
    assert load.array(path.name).tobytes() == new
    assert load.pinned(path.name, None)
    load.close()
    assert maps.stats.mapped == 2 and maps.stats.reused == 0
    # The old mapping was unpinned (and unmapped) before the new file was registered.
    assert [c[0] for c in fake.calls] == ["register", "unregister", "register"]
    assert list(fake.registered) == [maps.mapped()[path.name]]
    maps.close()


def test_an_unlinked_segment_is_unmapped_once_idle_and_not_before(shm_dir):
    path = shm_dir / "streamer-1-aa-3"
    _write(path, os.urandom(4096))
    fake = FakeCudart()
    maps = _maps(shm_dir, fake, sweep_s=3600)  # no janitor in the way: sweep by hand
    load = maps.load(populate=False)
    load.pinned(path.name, None)
    path.unlink()
    assert maps.sweep() == 0  # a load still uses it
    assert str(path) in _mapped_paths()
    load.close()  # the load's end sweeps
    assert maps.mapped() == {} and str(path) not in _mapped_paths()
    assert not fake.registered


def test_the_janitor_unmaps_segments_the_daemon_unlinked_after_the_last_load(shm_dir):
    path = shm_dir / "streamer-1-aa-4"
    _write(path, os.urandom(4096))
    maps = _maps(shm_dir, FakeCudart(), sweep_s=0.05)
    load = maps.load(populate=True)
    load.array(path.name)
    load.close()
    assert path.name in maps.mapped()  # kept for the next load while the file is there
    path.unlink()  # the daemon gave it back; this process loads nothing more
    deadline = time.monotonic() + 30
    # The janitor takes the segment out of its table, then unmaps it: wait for both.
    while (maps.mapped() or str(path) in _mapped_paths()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert maps.mapped() == {} and str(path) not in _mapped_paths()


def test_a_dedicated_segment_is_dropped_after_its_load(shm_dir):
    path = shm_dir / "streamer-1-aa-5"
    _write(path, os.urandom(4096))
    fake = FakeCudart()
    maps = _maps(shm_dir, fake)
    load = maps.load(populate=False)
    load.pinned(path.name, None)
    load.drop(path.name)
    assert maps.mapped() == {} and not fake.registered
    load.close()


def test_a_missing_segment_names_the_shared_dir(shm_dir):
    load = _maps(shm_dir, FakeCudart()).load(populate=False)
    with pytest.raises(streamer_client.errors.DaemonError, match="must share STREAMER_SHM_DIR"):
        load.array("streamer-1-aa-9")


def _loads_here(d: DaemonProcess, sample: Path, launches: tuple[str, ...], monkeypatch) -> Iterator[SegmentMaps]:
    """Load ``sample`` through ``d`` once per launch id in this process, every tensor checked
    against safetensors; after each load, this process's segment maps."""
    for key, value in d.rank_env().items():
        if key.startswith("STREAMER_"):
            monkeypatch.setenv(key, value)
    maps = segment_maps(d.shm_dir)
    truth = ground_truth(sample)
    for launch in launches:
        state = streamer_client.load_state_dict(str(sample), launch_id=launch)
        assert state.keys() == truth.keys()
        for name, want in truth.items():
            assert torch.equal(state[name].view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name
        del state
        yield maps


def test_a_reload_from_the_resident_copy_maps_no_segment_again(sample, tmp_path, monkeypatch):
    d = DaemonProcess(tmp_path, {"STREAMER_CACHE_DIR": str(tmp_path / "cache")}, "--retention-budget", "64MiB").start()
    try:
        loads = _loads_here(d, sample, ("cold", "warm"), monkeypatch)
        maps = next(loads)
        cold_mapped = maps.stats.mapped
        resident = set(maps.mapped())
        next(loads)
        assert maps.stats.mapped == cold_mapped and maps.stats.reused >= len(resident) > 0
        assert resident <= set(maps.mapped())
        assert d.finished(2)[-1]["bytes_read"] == 0
    finally:
        d.stop()
    maps.sweep()  # the daemon unlinked its segments at exit: nothing of them stays mapped here
    assert maps.mapped() == {} and str(d.shm_dir) not in _mapped_paths()
    assert np.array(list(d.shm_dir.iterdir())).size == 0


def test_a_reload_the_daemon_streams_again_maps_the_segments_of_the_last_load(sample, tmp_path, monkeypatch):
    """No retention, 8 MiB slots, a standing ring of 12 of which a load's ring uses a few (how many
    depends on how far the reads run ahead of the rank): each load takes the segments the last
    one gave back first (the most recently idle), so a process that loads three times has mapped
    no more segments than its largest ring held, not a new set each time."""
    env = {"STREAMER_CACHE_DIR": str(tmp_path / "cache"), "STREAMER_SLOT_SIZE": "8MiB", "STREAMER_SEGMENT_IDLE_S": "30"}
    d = DaemonProcess(tmp_path, env, "--shm-budget", "96MiB").start()
    try:
        mapped = [maps.stats.mapped for maps in _loads_here(d, sample, ("cold", "warm", "again"), monkeypatch)]
        assert all(f["bytes_read"] > 0 for f in d.finished(3))

        def logged() -> list[int] | None:  # a session's line follows its summary
            rings = [int(n) for n in re.findall(r"a ring of (\d+) slots", d.log.read_text())]
            return rings if len(rings) == 3 else None

        rings = wait_until(logged, 30, "the three loads' lines in the daemon's log")
    finally:
        d.stop()
    assert max(rings) < 12  # each load left idle segments it did not take
    assert mapped == [max(rings[: k + 1]) for k in range(3)]


class LateCopier:
    """The copier's interface over CPU clones, whose fences complete only at the second poll after
    them: a batch's release is known only after the next request went out (a slow copy engine)."""

    def __init__(self) -> None:
        self._queue: deque[list] = deque()

    def copy(self, host: torch.Tensor, dtype: str, shape) -> torch.Tensor:
        torch_type, dims = torch_layout(dtype, shape)
        return host.clone().view(torch_type).reshape(dims)

    def fence(self) -> object:
        return object()

    def release_after(self, callback, fence=None) -> None:
        self._queue.append([0, callback])

    def poll(self) -> int:
        for item in self._queue:
            item[0] += 1
        ran = 0
        while self._queue and self._queue[0][0] >= 2:
            self._queue.popleft()[1]()
            ran += 1
        return ran

    @property
    def pending(self) -> int:
        return len(self._queue)

    def wait_one(self) -> bool:
        if not self._queue:
            return False
        self._queue.popleft()[1]()
        return True

    def drain(self) -> None:
        while self._queue:
            self._queue.popleft()[1]()

    def close(self) -> None:
        self.drain()


def test_a_release_known_after_the_next_request_still_reaches_the_daemon(sample, daemon):
    """Copies stay in flight across requests; a batch whose copies land later is released with a
    later request (once lost: the ring ran dry and the load stalled, seen at 6.4 GB on an H200)."""
    d = daemon({"STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "4MiB")  # the ring must recycle
    client = DaemonClient(d.socket)
    joined = client.call("/v1/sessions/join", {"uri": str(sample), "session": "late", "rank": 0, "world_size": 1, "fence": True})
    segment_maps(d.shm_dir)._pinner = HostPinner(FakeCudart())
    fence = Fence(d.shm_dir / joined["generations"], joined["session_id"])
    receiver = Receiver(client, d.shm_dir, joined["session_id"], 0, torch.device("cpu"), False, fence=fence)
    receiver._copier = LateCopier()  # the device path of the receiver, without a GPU
    got: dict[str, torch.Tensor] = {}
    worker = threading.Thread(target=lambda: got.update(receiver.run()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the load stalled: a release never reached the daemon"
    truth = ground_truth(sample)
    assert got.keys() == truth.keys()
    assert all(torch.equal(got[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)) for n, t in truth.items())
    assert d.finished()[-1]["state"] == "done"
    client.close()


class DeferredCopier:
    """The copier's interface over CPU tensors whose bytes are copied only when their fence
    completes (at the second poll after it, or when waited for), as a DMA reads host memory until
    it completes. At each completion it asks ``holding()`` whether the daemon still counts the
    rank as holding its batches (``completions``); ``fail_at``: the copy that fails."""

    device = torch.device("cpu")

    def __init__(self, holding) -> None:
        self._holding = holding
        self._unfenced: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (host bytes, out, offset)
        self._queue: deque[list] = deque()  # [polls seen, copies, callbacks]
        self.completions: list[bool] = []
        self.completed_by_drain = 0
        self.copies = 0
        self.fail_at: int | None = None

    def empty(self, dtype: torch.dtype, shape) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def copy(self, host: torch.Tensor, dtype: str, shape) -> torch.Tensor:
        out = self.empty(*torch_layout(dtype, shape))
        self.copy_pieces(host, [(0, host.numel(), out, 0)])
        return out

    def copy_pieces(self, host: torch.Tensor, pieces) -> None:
        for at, nbytes, out, offset in pieces:
            self.copies += 1
            if self.copies == self.fail_at:
                raise RuntimeError("the copy engine failed")
            self._unfenced.append((host[at : at + nbytes], out, offset))

    def fence(self) -> list:
        copies, self._unfenced = self._unfenced, []
        self._queue.append([0, copies, []])
        return self._queue[-1]

    def release_after(self, callback, fence=None) -> None:
        (fence if fence is not None else self.fence())[2].append(callback)

    def _complete(self) -> int:
        _, copies, callbacks = self._queue.popleft()
        for host, out, offset in copies:
            out.reshape(-1).view(torch.uint8)[offset : offset + host.numel()].copy_(host)
        self.completions.append(self._holding())
        for callback in callbacks:
            callback()
        return len(callbacks)

    def poll(self) -> int:
        for item in self._queue:
            item[0] += 1
        ran = 0
        while self._queue and self._queue[0][0] >= 2:
            ran += self._complete()
        return ran

    @property
    def pending(self) -> int:
        return sum(len(item[2]) for item in self._queue)

    def wait_one(self) -> bool:
        while self._queue:
            if self._complete():
                return True
        return False

    def drain(self) -> None:
        if self._unfenced:
            self.fence()
        while self._queue:
            self._complete()
            self.completed_by_drain += 1

    def close(self) -> None:
        self.drain()


def _holds(d: DaemonProcess, session_id: str) -> bool:
    """Whether the daemon counts rank 0 of ``session_id`` as holding its batches (active)."""
    sessions = {s["id"]: s for s in d.stats()["sessions"]}
    return session_id in sessions and sessions[session_id]["ranks"]["0"]["status"] == "active"


@pytest.fixture
def small_staging_ring(monkeypatch):
    """The process's staging ring as three 1 MiB buffers made here (registering them needs CUDA)."""
    ring = delivery._StagingRing(3, 2**20)
    ring._slots = [anonymous(2**20) for _ in range(3)]
    monkeypatch.setattr(delivery, "_RING", ring)


def _device_receiver(d, uri: str, session: str, path: str) -> tuple[Receiver, DeferredCopier]:
    """A joined rank's receiver on its device paths without a GPU (``path``: page-locked or staged):
    the copier double above, its segments page-locked through the fake CUDA runtime."""
    client = DaemonClient(d.socket)
    joined = client.call("/v1/sessions/join", {"uri": uri, "session": session, "rank": 0, "world_size": 1, "fence": True})
    segment_maps(d.shm_dir)._pinner = HostPinner(FakeCudart())
    fence = Fence(d.shm_dir / joined["generations"], joined["session_id"])
    receiver = Receiver(client, d.shm_dir, joined["session_id"], 0, torch.device("cpu"), False, fence=fence)
    receiver._copier = copies = DeferredCopier(functools.partial(_holds, d, joined["session_id"]))
    receiver._stage = path == "staged"
    return receiver, copies


@pytest.mark.parametrize("path", ["page-locked", "staged"])
@pytest.mark.parametrize("end", ["finished", "closed", "failed"])
def test_a_device_load_drains_its_copies_before_it_leaves(sample, daemon, small_staging_ring, path, end):
    """The receiver's device paths, without a GPU: every copy out of the rank's segments (and out
    of the staging ring) completes while the daemon still counts the rank as holding its batches,
    however the load ends: finished, closed after 5 tensors with copies in flight, or failed at its
    20th copy. Once the rank has left, the daemon may write another load into those segments."""
    d = daemon({"STREAMER_SLOT_SIZE": "1MiB"}, "--shm-budget", "4MiB")  # the ring must recycle
    receiver, copies = _device_receiver(d, str(sample), "drain", path)
    if end == "failed":
        copies.fail_at = 20
    truth = ground_truth(sample)
    tensors = receiver.run()
    got: dict[str, torch.Tensor] = {}
    if end == "failed":
        with pytest.raises(RuntimeError, match="the copy engine failed"):
            got.update(tensors)
    elif end == "closed":
        got.update(next(tensors) for _ in range(5))
        tensors.close()
    else:
        got.update(tensors)
        assert got.keys() == truth.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor.view(-1).view(torch.uint8), truth[name].view(-1).view(torch.uint8)), name
    assert copies.completed_by_drain > 0  # the load ended with copies in flight
    assert copies.completions and all(copies.completions), copies.completions
    status = {"finished": "done", "closed": "left", "failed": "failed"}[end]
    assert d.finished()[-1]["ranks"]["0"]["status"] == status


# A fresh rank process loads SOURCE (launch "warm"; "borrowed": borrowed views), every tensor
# compared with safetensors; a StreamerError ends it with exit 3 and what it got before.
WARM_RANK = textwrap.dedent(
    """
    import json, sys, torch, streamer_client
    from safetensors.torch import load_file
    uri, borrowed = sys.argv[1], sys.argv[2] == "borrowed"
    index = json.load(open(uri + "/model.safetensors.index.json"))["weight_map"]
    truth = {}
    for shard in set(index.values()):
        truth.update(load_file(uri + "/" + shard))
    got, bad = [], []
    try:
        for name, t in streamer_client.stream(uri, borrowed=borrowed, launch_id="warm"):
            if not torch.equal(t.reshape(-1).view(torch.uint8), truth[name].reshape(-1).view(torch.uint8)):
                bad.append(name)
            got.append(name)
    except streamer_client.errors.StreamerError as exc:
        print(json.dumps({"got": got, "bad": bad, "error": {"type": type(exc).__name__, "message": str(exc), "key": exc.key}}))
        sys.exit(3)
    print(json.dumps({"got": got, "bad": bad}))
    """
)

PAST_THE_END = re.compile(
    r"shared-memory segment (\S+): tensor '(.+)': bytes (\d+)-(\d+) are outside the segment's (\d+) bytes as this "
    r"rank mapped it \(its file cut short or replaced, or a handle the daemon got wrong\); nothing of it was read"
)


def _resident_cut_in_half(sample: Path, daemon) -> tuple[DaemonProcess, dict[str, int]]:
    """A daemon keeping ``sample`` resident after a first load, its segment files then cut to half
    their size: a later load is handed handles past the end of the files a new process maps.
    Returns the daemon and ``{segment: size now}``."""
    d = daemon({"STREAMER_SLOT_SIZE": "4MiB"}, "--retention-budget", "64MiB")
    cold = subprocess.run([sys.executable, "-c", WARM_RANK.replace('"warm"', '"cold"'), str(sample), "owned"],
                          env=d.rank_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert json.loads(cold.stdout)["bad"] == []
    sizes = {}
    for path in d.shm_dir.iterdir():
        if path.name.startswith("streamer-"):
            sizes[path.name] = path.stat().st_size // 2
            os.truncate(path, sizes[path.name])
    assert sizes
    return d, sizes


def _past_the_end(message: str, key: str | None, sizes: dict[str, int]) -> str:
    """The tensor a ``DaemonError`` for a handle past the end of its segment names, checked."""
    match = PAST_THE_END.fullmatch(message)
    assert match, message
    segment, name, start, end, size = match.groups()
    assert key == name and int(size) == sizes[segment] and int(start) < int(end) and int(end) > int(size)
    return name


@pytest.mark.parametrize("mode", ["owned", "borrowed"])
def test_a_handle_past_the_end_of_its_segment_is_refused_on_the_cpu_paths(sample, daemon, mode):
    """A real rank process maps segment files cut short before it mapped them: the first handle
    past the end is a DaemonError naming the tensor, the segment and the bounds; every tensor
    delivered before it equals safetensors' (before: an owned tensor half uninitialised, an empty
    or short borrowed view)."""
    d, sizes = _resident_cut_in_half(sample, daemon)
    warm = subprocess.run([sys.executable, "-c", WARM_RANK, str(sample), mode], env=d.rank_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert warm.returncode == 3, warm.stderr[-3000:]
    result = json.loads(warm.stdout)
    assert result["error"]["type"] == "DaemonError"
    name = _past_the_end(result["error"]["message"], result["error"]["key"], sizes)
    assert result["bad"] == [] and name not in result["got"]
    session = d.finished()[-1]
    assert session["ranks"]["0"]["status"] == "failed" and "DaemonError" in session["ranks"]["0"]["error"]


@pytest.mark.parametrize("path", ["page-locked", "staged"])
def test_a_handle_past_the_end_of_its_segment_is_refused_on_the_device_paths(sample, daemon, small_staging_ring, path):
    """The receiver's device paths, without a GPU (the copier double above), on segment files cut
    short before this process mapped them: DaemonError naming the tensor, segment and bounds
    before any copy of it is queued (before: the staged path copied from an address past the
    mapping); the copies queued before it complete before the rank leaves."""
    d, sizes = _resident_cut_in_half(sample, daemon)
    receiver, copies = _device_receiver(d, str(sample), "warm", path)
    truth = ground_truth(sample)
    got: dict[str, torch.Tensor] = {}
    with pytest.raises(streamer_client.errors.DaemonError) as failed:
        got.update(receiver.run())
    name = _past_the_end(str(failed.value), failed.value.key, sizes)
    assert name not in got
    for tensor_name, tensor in got.items():
        assert torch.equal(tensor.view(-1).view(torch.uint8), truth[tensor_name].view(-1).view(torch.uint8)), tensor_name
    assert all(copies.completions)
    assert d.finished()[-1]["ranks"]["0"]["status"] == "failed"


@pytest.mark.parametrize("borrowed", [False, True], ids=["shared-mapping", "private-mapping"])
@pytest.mark.parametrize(
    ("offset", "nbytes", "dtype", "shape", "problem"),
    [
        (8192, 8192, "F32", (2048,), "bytes 8192-16384 are outside the segment's 12288 bytes as this rank mapped it"),
        (16384, 4, "F32", (1,), "bytes 16384-16388 are outside the segment's 12288 bytes"),
        (-4, 8, "F32", (2,), "bytes -4-4 are outside the segment's 12288 bytes"),
        (0, 12, "F32", (4,), "12 bytes, but a F32 tensor of shape [4] takes 16"),
        (0, 4, "F4", (3,), "4 bytes, but a F4 tensor of shape [3] is no whole number of bytes"),
        (0, 0, "U8", (-1,), "0 bytes of shape [-1] is not a size"),
    ],
    ids=["ends-past-the-end", "starts-past-the-end", "negative-offset", "size-not-the-shape-s", "no-whole-bytes", "negative-dim"],
)
def test_a_handle_that_does_not_fit_its_segment_is_refused_before_a_byte_is_read(
    shm_dir, borrowed, offset, nbytes, dtype, shape, problem
):
    """The one check every delivery path reads a handle's bytes through, on a real segment file of
    12 KiB mapped by the receiver; a handle that fits gives exactly its bytes."""
    data = os.urandom(3 * 4096)
    _write(shm_dir / "streamer-1-aa-1", data)
    segment_maps(shm_dir)._pinner = HostPinner(FakeCudart())
    fence = Fence(shm_dir / "streamer-1-aa.generations", "s")  # no daemon: the table is never read here
    receiver = Receiver(DaemonClient(shm_dir / "no.sock"), shm_dir, "s", 0, torch.device("cpu"), borrowed, fence=fence)
    try:
        fits = Handle(0, "streamer-1-aa-1", 4096, 8192, "w", "F32", (2048,), False)
        assert receiver._source(fits).tobytes() == data[4096:]
        with pytest.raises(streamer_client.errors.DaemonError) as refused:
            receiver._source(Handle(0, "streamer-1-aa-1", offset, nbytes, "layers.0.w", dtype, shape, False))
        assert str(refused.value).startswith(f"shared-memory segment streamer-1-aa-1: tensor 'layers.0.w': {problem}")
        assert refused.value.key == "layers.0.w"
        with pytest.raises(streamer_client.errors.DaemonError, match="tensor 'e': 16 bytes in no segment"):
            receiver._source(Handle(0, None, 0, 16, "e", "F32", (4,), False))
    finally:
        receiver._segments.close()
