"""The process's native copier: threads that copy byte ranges between addresses (``_copier.c``).

Used wherever bytes already in memory (a mapped file, a mapped daemon segment) go into a buffer
of ours: the embedded engine's mapped reader of local files (``streamer_service.readers.mapped``), and
:mod:`streamer_client._delivery` (a rank's CPU tensors, and the pinned staging of its device
copies). One pool per process, made on first use; a forked child makes its own.

The interpreter is involved twice per batch: :func:`submit` queues every range (split into
chunks of :data:`CHUNK_BYTES`) with one call, :func:`wait` waits for them with the GIL released.
A source that is a file mapping and was cut short under it raises SIGBUS in a copying thread:
the copier catches it, and :func:`wait` answers the index of the first copy that hit it (the
caller names the file or segment and the range). :func:`copy_here` copies a small batch on the
calling thread under the same guard. The guard survives a SIGBUS handler installed after the pool
(``faulthandler.enable()``): each batch installs it again and chains to the newcomer. What is not
a copy's fault (a SIGBUS sent by ``kill``, a hardware memory error) goes where it would have gone
without the copier.

Optional: the extension is built by ``pip install`` where a C compiler is present. Without it
:func:`available` is false and callers copy another way (numpy, or Run:ai's reader).
"""

from __future__ import annotations

import contextlib
import os
import time
from array import array
from collections.abc import Sequence
from typing import Any

from ._per_process import PerProcess
from ._waits import slice_ms

try:
    from . import _copier
except ImportError:  # built without a C compiler
    _copier = None

__all__ = [
    "CHUNK_BYTES", "COPY_THREADS", "advise_huge", "available", "copy", "copy_here", "map_file", "pool", "share_host", "submit", "threads_for", "unmap",
    "wait",
]  # fmt: skip

COPY_THREADS = min(12, len(os.sched_getaffinity(0)))
"""Most copying threads of a process's pool: enough to saturate host-to-device copies on a 16-CPU
host while leaving CPUs for the loading thread and the DMA completions."""
CHUNK_BYTES = 2 * 1024 * 1024  # 1 MiB: the same within noise; 4 MiB: slower


def threads_for(ranks: int, cpus: int) -> int:
    """Copying threads of one of ``ranks`` processes loading at once on a host of ``cpus`` CPUs:
    its share of the CPUs, at least two, at most :data:`COPY_THREADS` (ranks that each ran the
    most would outnumber the cores, and a window waits for its slowest chunk)."""
    return max(2, min(COPY_THREADS, cpus // max(1, ranks)))


def _local_ranks() -> int:
    try:  # torchrun's: the processes it started on this host
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


_ranks_on_host = _local_ranks()


def share_host(ranks: int) -> None:
    """This process is one of ``ranks`` processes loading on its host at once (a daemon session's
    ranks, all on the daemon's node): the pool, once made, has :func:`threads_for` them. No effect
    once the pool is made."""
    global _ranks_on_host
    _ranks_on_host = max(_ranks_on_host, ranks)


def _make_pool() -> Any:
    return _copier.pool(threads_for(_ranks_on_host, len(os.sched_getaffinity(0))), CHUNK_BYTES)


# A forked child has none of the parent's copying threads: it makes its own pool on first use
# (the parent's refuses to be used or stopped there, _copier.c).
_POOL: PerProcess[Any] = PerProcess(_make_pool)


def available() -> bool:
    """Whether the native copier was built."""
    return _copier is not None


def pool() -> Any:
    """The process's pool of copying threads (made on first use)."""
    return _POOL.get()


def submit(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> int:
    """Queue one batch of copies (``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]``); its ticket.

    The caller keeps every source and destination alive until :func:`wait` answered."""
    return _copier.submit(pool(), _words(dsts), _words(srcs), _words(sizes))


def wait(ticket: int, timeout_s: float | None = None) -> int | None:
    """Wait for a batch: -1, or the index of its first copy that hit SIGBUS (a file cut short).
    ``None`` when ``timeout_s`` passed first: the batch is still queued, to be waited for again.

    An exception while waiting (Ctrl-C) is raised once the batch is done: until then the copying
    threads write into buffers that the caller may free as the exception goes up."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while (failed := _copier.wait(pool(), ticket, slice_ms(deadline))) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
    except BaseException:
        with contextlib.suppress(ValueError):  # the batch is not queued (the error itself): nothing runs
            _copier.wait(pool(), ticket, -1)
        raise
    return failed


def copy(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> int:
    """One batch of copies, done when this returns (a Ctrl-C meanwhile is raised after it): -1,
    or the index of the first copy that hit SIGBUS."""
    return _copier.copy(pool(), _words(dsts), _words(srcs), _words(sizes))


def copy_here(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]) -> int:
    """One batch of copies on the calling thread (one too small to hand to the pool's threads),
    under the same guard: -1, or the index of the first copy that hit SIGBUS."""
    return _copier.copy_here(_words(dsts), _words(srcs), _words(sizes))


def map_file(fd: int, nbytes: int) -> int:
    """The address of a read-only shared mapping of ``nbytes`` of the file ``fd`` (which may be
    closed afterwards: unlike Python's mmap, no duplicate descriptor is kept per mapping)."""
    return _copier.map(fd, nbytes)


def unmap(address: int, nbytes: int) -> None:
    _copier.unmap(address, nbytes)


def advise_huge(address: int, nbytes: int) -> bool:
    """Advise the whole pages of ``nbytes`` at ``address`` for transparent huge pages before their
    first touch (what numpy does for its large arrays): a fresh page then costs one fault per
    2 MiB instead of one per 4 KiB. Whether the kernel took the advice (not without the extension,
    nor where THP is off)."""
    return _copier is not None and _copier.advise_huge(address, nbytes)


def _words(values: Sequence[int]) -> bytes:
    """``values`` as native unsigned 64-bit words: an ``array('Q')`` or a numpy ``uint64`` array as
    they are, any other sequence of ints converted."""
    if isinstance(values, array) or getattr(values, "dtype", None) == "uint64":
        return values.tobytes()
    return array("Q", values).tobytes()
