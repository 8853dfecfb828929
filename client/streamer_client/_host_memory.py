"""Host memory for buffers: private anonymous mappings, advised for transparent huge pages.

Both modes make their buffers here: the embedded engine's ring slots, which the reader writes
into, and the page-locked staging ring a rank copies through to a device. Two rules:

- **private**: Python's default for an anonymous ``mmap`` is shared, i.e. shmem, which gets no
  transparent huge pages (shmem has its own switch, off by default);
- **advised for huge pages** (``MADV_HUGEPAGE``, as numpy does for large arrays): fresh memory is
  filled only as fast as its pages fault in, and page-locking it (``cudaHostRegister``) faults
  every page first; huge pages fault in a 512th as often. Advice only: a kernel without THP
  refuses it and the memory works as before.

Fresh memory that is page-locked before anything is written into it (the staging ring) is
faulted in first, on the native copier's threads (:func:`fault_in`): a page's first touch is a
fault and a zero-fill, and ``cudaHostRegister`` of fresh memory makes every one of them on the
calling thread, at one thread's rate; faulted in on the copier's threads side by side and then
registered, the same buffers are page-locked sooner. The embedded engine's slots are page-locked
after their first fill, whose copying threads have faulted them in.

The memory lives as long as the returned array and every view of it (a tensor built over the
array holds it); it goes back to the OS with the last one.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
from collections.abc import Sequence

import numpy as np

from . import _native_copier as copier

__all__ = ["anonymous", "fault_in"]

_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def anonymous(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh, page-aligned, private memory as a uint8 array (see the module docstring)."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGEPAGE is not None:
        with contextlib.suppress(OSError):
            memory.madvise(_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint8)


@functools.cache
def _zeros() -> np.ndarray:
    """One copier chunk of memory never written: reading it maps the kernel's zero page, so copying
    from it allocates nothing. Every copy of :func:`fault_in` reads it."""
    return anonymous(copier.CHUNK_BYTES)


def fault_in(buffers: Sequence[np.ndarray]) -> None:
    """Fault in every page of fresh ``buffers`` (from :func:`anonymous`, never written) on the
    copier's threads, all buffers at once, before they are page-locked. It writes zeros over them:
    fresh memory reads as zeros, so nothing changes. Without the native copier, nothing: their
    registration or first use faults them in."""
    if not copier.available() or not buffers:
        return
    zeros = _zeros()
    chunk = zeros.nbytes
    dsts, sizes = [], []
    for buffer in buffers:
        base, nbytes = buffer.ctypes.data, buffer.nbytes
        for at in range(0, nbytes, chunk):
            dsts.append(base + at)
            sizes.append(min(chunk, nbytes - at))
    failed = copier.copy(dsts, [zeros.ctypes.data] * len(dsts), sizes)
    if failed >= 0:  # SIGBUS: only a file mapping cut short raises it, and these are not
        raise ValueError(f"fault_in: buffer memory at 0x{dsts[failed]:x} is not anonymous memory")
