"""Host memory for buffers: private anonymous mappings, advised for transparent huge pages.

Both modes make their buffers here: the embedded engine's ring slots, which the reader writes
into, and the page-locked staging ring a rank copies through to a device. Two rules:

- **private**: Python's default for an anonymous ``mmap`` is shared, i.e. shmem, which gets no
  transparent huge pages (shmem has its own switch, off by default);
- **advised for huge pages** (``MADV_HUGEPAGE``, as numpy does for large arrays): fresh memory is
  filled only as fast as its pages fault in, and page-locking it (``cudaHostRegister``) faults
  every page first; huge pages fault in a 512th as often (docs/benchmarks.md has what that
  saved a first load). Advice only: a kernel without THP refuses it and the memory works as
  before.

The memory lives as long as the returned array and every view of it (a tensor built over the
array holds it); it goes back to the OS with the last one.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

__all__ = ["anonymous"]

_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def anonymous(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh, page-aligned, private memory as a uint8 array (see the module docstring)."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if _HUGEPAGE is not None:
        with contextlib.suppress(OSError):
            memory.madvise(_HUGEPAGE)
    return np.frombuffer(memory, dtype=np.uint8)
