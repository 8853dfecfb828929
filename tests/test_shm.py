"""Shared-memory segments as mapped: every page mapped already where populated (the daemon's, as
Run:ai's threads write into them; a rank's for CPU copies), with or without the kernel's
piecewise populate (``streamer_client._segments.map_shared``), which leaves the GIL to the process's
other threads."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from smaps import resident_bytes

from streamer_client import _segments as segments
from streamer_client._segments import map_segment
from streamer_service.daemon import shm
from streamer_service.daemon.generations import TABLE_SUFFIX
from streamer_service.daemon.shm import Segment

MIB = 2**20


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield Path(d)


def test_a_new_segment_is_mapped_whole_when_made(shm_dir):
    segment = Segment("seg-1", shm_dir / "seg-1", 20 * MIB + 4096)  # pieces of 8 MiB and a short last one
    try:
        assert resident_bytes(segment.address) == segment.nbytes
        assert bytes(segment.array[:4096]) == bytes(4096) and segment.array[-1] == 0
    finally:
        segment.close()
    # What the check tells apart: the same file mapped without populating has nothing mapped yet.
    fd = os.open(shm_dir / "plain", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, 8 * MIB)
        plain = mmap.mmap(fd, 8 * MIB, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    view = np.frombuffer(plain, dtype=np.uint8)
    try:
        assert resident_bytes(view.ctypes.data) == 0
    finally:
        del view
        plain.close()


def test_a_large_segment_is_filled_by_threads_side_by_side(shm_dir, monkeypatch):
    monkeypatch.setattr(shm, "FILL_SHARE", 2 * MIB)  # 256 MiB by default: an oversized tensor's segment
    monkeypatch.setattr(shm, "FILL_THREADS", 3)
    monkeypatch.setattr(shm, "_FILLERS", None)
    filled, populate = [], segments.populate_pages
    monkeypatch.setattr(segments, "populate_pages", lambda address, nbytes, **kw: filled.append(
        (threading.current_thread().name, nbytes)) or populate(address, nbytes, **kw))  # fmt: skip
    segment = Segment("seg-1", shm_dir / "seg-1", 20 * MIB + 4096)
    try:
        assert os.stat(segment.path).st_blocks * 512 >= segment.nbytes  # every page allocated in the file
        assert resident_bytes(segment.address) == segment.nbytes  # and mapped
        assert bytes(segment.array[:4096]) == bytes(4096) and segment.array[-1] == 0
        segment.array[:] = 7
    finally:
        segment.close()
        shm._fillers().shutdown()
    # Three shares of whole 8 MiB pieces, one on the making thread, two on the fillers' threads.
    assert sorted(n for _, n in filled) == [4 * MIB + 4096, 8 * MIB, 8 * MIB]
    assert sum(name.startswith("segment-fill") for name, _ in filled) == 2
    assert list(shm_dir.iterdir()) == []


_FULL_SHM = """
import sys
from pathlib import Path
import streamer_service.daemon.shm as shm
from streamer_client.errors import ConfigError
shm.FILL_SHARE = int(sys.argv[2])
try:
    shm.Segment("seg-1", Path(sys.argv[1]) / "seg-1", 8 * 2**20)
except ConfigError as exc:
    print(exc)
print("left:", sorted(p.name for p in Path(sys.argv[1]).iterdir()))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a private mount namespace"
)
@pytest.mark.parametrize("share", [MIB, 256 * MIB], ids=["filled-by-threads", "fallocate"])
def test_a_segment_larger_than_the_shm_filesystem_is_a_config_error_and_leaves_no_file(tmp_path, share):
    (shm_dir := tmp_path / "segments").mkdir()
    mount = f"mount -t tmpfs -o size=3m tmpfs {shm_dir}"
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", f'{mount} && exec "$@"', "sh"]
    out = subprocess.run([*cmd, sys.executable, "-c", _FULL_SHM, str(shm_dir), str(share)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"shared-memory dir {shm_dir} has no room for a {8 * MIB}-byte segment: make the shm filesystem larger than "
        "STREAMER_SHM_BUDGET or lower the budget",
        "left: []",
    ]


@pytest.mark.parametrize("share", [256 * MIB, 2 * MIB], ids=["fallocate", "filled-by-threads"])
def test_where_the_kernel_refuses_piecewise_populate_one_call_maps_the_segment(shm_dir, monkeypatch, share):
    # No such advice: EINVAL, as from a kernel before 5.14.
    monkeypatch.setattr(segments, "_POPULATE", {False: 1000, True: 1000})
    monkeypatch.setattr(segments, "_piecewise", True)
    monkeypatch.setattr(shm, "FILL_SHARE", share)
    segment = Segment("seg-1", shm_dir / "seg-1", 12 * MIB)
    try:
        assert segments._piecewise is False  # the next segments go straight to the one call
        assert resident_bytes(segment.address) == segment.nbytes
        segment.array[:] = 7
    finally:
        segment.close()
    assert list(shm_dir.iterdir()) == []


def test_a_rank_maps_a_segment_whole_for_cpu_copies_and_lazily_otherwise(shm_dir):
    segment = Segment("seg-1", shm_dir / "seg-1", 9 * MIB)
    try:
        segment.array[-1] = 5
        for populate, mapped in ((True, segment.nbytes), (False, 0)):
            mapping, identity = map_segment(segment.path, populate=populate)
            view = np.frombuffer(mapping, dtype=np.uint8)
            try:
                assert resident_bytes(view.ctypes.data) == mapped and identity[2] == segment.nbytes
                assert mapping[-1] == 5
            finally:
                del view
                mapping.close()
    finally:
        segment.close()


def test_populating_pages_leaves_the_gil_to_the_process_s_other_threads():
    """A daemon makes segments on maker threads while its loading thread and HTTP server run: the
    populating call must not hold the GIL. Its pages are held by the kernel (``held_pages``), so
    the call cannot end before the child's main thread, running Python meanwhile, lets it. In a
    child process: a call that held the GIL would hang it."""
    code = f"""
        import sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from held_pages import HeldPages
        from streamer_client._segments import populate_pages

        held = HeldPages(8 * {MIB}, release_after_s=60)
        done = threading.Event()

        def populate():
            populate_pages(held.array.ctypes.data, 8 * {MIB}, writable=True, piece=2 * {MIB})
            done.set()

        threading.Thread(target=populate, daemon=True).start()
        assert held.wait_for_fault(30), "the populating thread never touched the held pages"
        print("ran while the pages were held", flush=True)
        assert not done.is_set()
        held.release()
        assert done.wait(30)
        print("populated", flush=True)
    """
    try:
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the populating call held the GIL: the child's main thread never ran ({exc.stdout!r})")
    if child.returncode != 0 and "userfaultfd" in child.stdout + child.stderr and "Skipped" in child.stderr:
        pytest.skip(child.stderr.strip().splitlines()[-1])
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["ran while the pages were held", "populated"]


_HOLDER = """
import sys
from pathlib import Path
from streamer_service.daemon.shm import SegmentStore
store = SegmentStore(Path(sys.argv[1]))
made = [store.create(2**20) for _ in range(2)]
print(" ".join(s.name for s in made), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="unshare --pid needs root")
def test_a_sweep_removes_the_segments_of_a_process_killed_9_and_never_those_of_a_live_one(shm_dir):
    """Whether a segment's maker lives is its lock on the segment, whatever its PID says: the maker
    is PID 1 of a PID namespace of its own (as in a container); the sweep leaves its segments and
    its generations table (and files not named as segments) while it lives, and removes them once
    it was killed -9."""
    cmd = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL", sys.executable, "-c", _HOLDER, str(shm_dir)]
    holder = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        made = holder.stdout.readline().split()
        assert len(made) == 2 and all(n.startswith("streamer-1-") for n in made), made
        (shm_dir / "streamer-notes").write_text("not a segment")
        # The maker's generations table holds its lock as its segments do: swept with them, never before.
        made += [p.name for p in shm_dir.iterdir() if p.name.endswith(TABLE_SUFFIX)]
        assert len(made) == 3, made
        assert shm.sweep_stale_segments(shm_dir) == []
        assert sorted(p.name for p in shm_dir.iterdir()) == sorted([*made, "streamer-notes"])
        holder.kill()  # unshare, and with it the maker (--kill-child)
        holder.wait(timeout=30)
        swept: set[str] = set()
        deadline = time.monotonic() + 30
        while swept != set(made) and time.monotonic() < deadline:
            swept.update(shm.sweep_stale_segments(shm_dir))
            time.sleep(0.05)
        assert swept == set(made)
        assert [p.name for p in shm_dir.iterdir()] == ["streamer-notes"]
    finally:
        holder.kill()
        holder.communicate()
