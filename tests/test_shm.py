"""The daemon's shared-memory segments as mapped when made: every page mapped already (Run:ai's
threads write into them without a fault per page), with or without the kernel's piecewise
populate."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path

import pytest

from streamer_service.daemon import shm
from streamer_service.daemon.shm import Segment

MIB = 2**20


@pytest.fixture
def shm_dir():
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield Path(d)


def _mapped_bytes(address: int) -> int:
    """Bytes of the mapping starting at ``address`` that this process has page-table entries for."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split()[0].split("-")[0] == f"{address:x}":
            rss = next(entry for entry in lines[i + 1 :] if entry.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_new_segment_is_mapped_whole_when_made(shm_dir):
    segment = Segment("seg-1", shm_dir / "seg-1", 20 * MIB + 4096)  # pieces of 8 MiB and a short last one
    try:
        assert _mapped_bytes(segment.address) == segment.nbytes
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
    view = (ctypes.c_char * 1).from_buffer(plain)
    try:
        assert _mapped_bytes(ctypes.addressof(view)) == 0
    finally:
        del view
        plain.close()


def test_where_the_kernel_refuses_piecewise_populate_one_call_maps_the_segment(shm_dir, monkeypatch):
    monkeypatch.setattr(shm, "_POPULATE_WRITE", 1000)  # no such advice: EINVAL, as from a kernel before 5.14
    monkeypatch.setattr(shm, "_piecewise", True)
    segment = Segment("seg-1", shm_dir / "seg-1", 12 * MIB)
    try:
        assert shm._piecewise is False  # the next segments go straight to the one call
        assert _mapped_bytes(segment.address) == segment.nbytes
        segment.array[:] = 7
    finally:
        segment.close()
    assert list(shm_dir.iterdir()) == []
