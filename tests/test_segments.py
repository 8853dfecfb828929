"""A rank maps (and page-locks) each daemon segment once per process, and never a stale one.

Real segment files in shared memory, a real daemon for the reload; CUDA registration through the
fake runtime of tests/test_cuda.py (the GPU tests run the real one: tests/test_cuda_daemon.py).
"""

from __future__ import annotations

import os
import re
import tempfile
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
from streamer_client.daemon import DaemonClient, _Receiver
from streamer_client.dtypes import torch_dtype
from streamer_client.fence import Fence
from streamer_client.pinning import HostPinner
from streamer_client.segments import POPULATE_PIECE, SegmentMaps, segment_maps


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
        assert load.view("streamer-1-aa-1", 4096, 8192).tobytes() == data[4096:]
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
    assert load.view("streamer-1-aa-9", 0, nbytes).tobytes() == data
    load.close()
    maps.close()


def test_a_segment_replaced_under_its_name_is_never_mistaken_for_the_old_one(shm_dir):
    path = shm_dir / "streamer-1-aa-2"
    old, new = os.urandom(8192), os.urandom(8192)
    _write(path, old)
    fake = FakeCudart()
    maps = _maps(shm_dir, fake)
    load = maps.load(populate=False)
    assert load.view(path.name, 0, 8192).tobytes() == old and load.pinned(path.name, None)
    load.close()
    path.unlink()
    _write(path, new)  # same name and size, another file
    load = maps.load(populate=False)
    assert load.view(path.name, 0, 8192).tobytes() == new
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
    load.view(path.name, 0, 4096)
    load.close()
    assert path.name in maps.mapped()  # kept for the next load while the file is there
    path.unlink()  # the daemon gave it back; this process loads nothing more
    deadline = time.monotonic() + 30
    while maps.mapped() and time.monotonic() < deadline:
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
        load.view("streamer-1-aa-9", 0, 1)


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
        return host.clone().view(torch_dtype(dtype)).reshape(shape)

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
    receiver = _Receiver(client, d.shm_dir, joined["session_id"], 0, torch.device("cpu"), False, fence=fence)
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
