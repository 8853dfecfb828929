"""Buffer memory (streamer_client._host_memory): private, advised for huge pages, and faulted in on
the copier's threads before it is page-locked. Read from the kernel's own account of the
process's mappings (/proc/self/smaps and /proc/self/pagemap)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from smaps import mapping as _mapping
from smaps import resident_in

from streamer_client import _native_copier as copier
from streamer_client._host_memory import anonymous, fault_in

MIB = 1024 * 1024


def _resident(buffer: np.ndarray) -> int:
    return resident_in(buffer.ctypes.data, buffer.nbytes)


def test_buffer_memory_is_private_and_advised_for_huge_pages():
    buffer = anonymous(4 * MIB)
    entry = _mapping(buffer.ctypes.data)
    assert entry["perms"] == "rw-p"  # private: shared anonymous memory is shmem, with no huge pages
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in entry["VmFlags"].split()
    assert buffer.nbytes == 4 * MIB and not buffer.any() and _resident(buffer) == 0


@pytest.mark.skipif(not copier.available(), reason="the native copier is not built")
def test_fault_in_makes_every_page_resident_and_leaves_the_zeros():
    buffers = [anonymous(3 * MIB + 4096), anonymous(2 * MIB)]  # a last chunk shorter than the copier's
    assert [_resident(b) for b in buffers] == [0, 0]
    fault_in(buffers)
    assert [_resident(b) for b in buffers] == [b.nbytes for b in buffers]
    assert not any(b.any() for b in buffers)


@pytest.mark.skipif(not copier.available(), reason="the native copier is not built")
def test_fault_in_of_a_file_mapping_cut_short_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"\0" * (2 * MIB))
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 2 * MIB)
    buffer = np.frombuffer(mapping, dtype=np.uint8)
    path.write_bytes(b"")  # truncated under the mapping: a write to it raises SIGBUS
    with pytest.raises(ValueError, match=rf"^fault_in: buffer memory at 0x{buffer.ctypes.data:x} is not anonymous memory$"):
        fault_in([buffer])


@pytest.mark.skipif(not copier.available() or not hasattr(mmap, "MADV_HUGEPAGE"), reason="needs the native copier and THP")
def test_huge_page_advice_reaches_the_whole_pages_of_the_range_and_nothing_else():
    memory = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(memory, dtype=np.uint8).ctypes.data
    assert "hg" not in _mapping(base).get("VmFlags", "").split()
    # From 100 bytes into the third MiB to the end of the sixth: the whole pages inside are advised.
    assert copier.advise_huge(base + 2 * MIB + 100, 4 * MIB - 100)
    flags = {at: _mapping(base + at)["VmFlags"].split() for at in (0, 2 * MIB, 2 * MIB + 4096, 6 * MIB - 4096, 6 * MIB)}
    assert ["hg" in f for f in flags.values()] == [False, False, True, True, False]
    assert not copier.advise_huge(base + 100, 4000)  # no whole page inside: nothing advised
    assert "hg" not in _mapping(base + 100)["VmFlags"].split()
