"""Local checkpoint files read through mappings, by native copying threads.

Run:ai's reader reads a local file with ``pread`` into our buffers. For files already in memory
(tmpfs, the page cache) the cost is the kernel's copy on each reading thread, slower than
InstantTensor, which maps its files and ``memcpy`` s them on many threads. :class:`MappedReader` is the same idea behind the interface of
:class:`~streamer_service.readers.base.Reader`, as Run:ai's, so the pipeline, the ring and the
version checks are the same for both:

- each file is mapped read-only once and the mapping is kept (:class:`FileMaps`): a later load
  of the same file, unchanged (same device, inode, size, mtime and ctime), copies out of page
  tables that are already filled. Mapping costs nothing; filling the page tables is a first
  load's cost, and unmapping 6 GB of 4 KiB pages is slow, so neither is paid per load. Mappings
  not used by a load for ``idle_s`` seconds (:data:`IDLE_S`) are dropped, so a checkpoint deleted
  from tmpfs gives its memory back then at the latest;
- every batch's ranges are copied by the process's native copier
  (:mod:`streamer_client._native_copier`), split into
  chunks; the interpreter queues a batch with one call and waits for it with one call, the GIL
  released. Python threads copying the same chunks are slower: they need the GIL
  between chunks;
- a file cut short under its mapping raises SIGBUS on the next access past its end. The copying
  threads catch it and the range fails with :class:`ObjectChangedError`, as a
  ``pread`` past the end fails in Run:ai's reader; a range beyond the size the file had when
  mapped fails the same way without being copied. A missing or unreadable file is a
  :class:`StorageError` naming it. The version check after each batch (``versions``) still
  catches a file rewritten in place.

Chosen (:func:`~streamer_service.readers.choice.reader_for`) for local directories, by embedded loads to a CUDA device and by the
daemon, when the extension is built (``pip install`` builds it; it is optional, and without a C
compiler loads go through Run:ai as before) and the operator has not chosen a filesystem strategy
for Run:ai (``RUNAI_STREAMER_FS_STRATEGY``, e.g. direct I/O for a cold NVMe checkpoint larger
than RAM). ``STREAMER_LOCAL_READER=runai`` turns it off. Embedded CPU loads keep Run:ai's reader,
which reads straight into memory the caller keeps.

Memory: a mapped page of a file is the page cache's, not more memory, but the kernel counts the
pages a process has mapped in its RSS (``RssFile``, or ``RssShmem`` for tmpfs) and in its OOM
score. While mappings are kept, a process's RSS includes the checkpoint's bytes it read: up to
``idle_s`` after its last load.
"""

from __future__ import annotations

import os
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from streamer_client import _native_copier as copier
from streamer_client._native_copier import _copier  # None where it did not build: Run:ai reads local files
from streamer_client._per_process import PerProcess
from streamer_client.errors import ObjectChangedError, StorageError

from .base import FileReads, RangeResult, ReadRange

__all__ = ["IDLE_S", "FileMaps", "MappedReader", "available", "cut_short", "file_maps", "shorter", "unmappable"]

IDLE_S = 30.0  # a file mapping no load used for this long is dropped


def available() -> bool:
    """Whether the native copier was built (see the module docstring)."""
    return _copier is not None


# --------------------------------------------------------------------------- mappings


class _Identity(NamedTuple):
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class _Mapping:
    """One file mapped read-only, whole, at ``address``; unmapped when the last reference goes
    (the cache's, and those of submissions whose copies may still read it)."""

    __slots__ = ("path", "identity", "address", "size", "last_used")

    def __init__(self, path: str, identity: _Identity, fd: int) -> None:
        self.path = path
        self.identity = identity
        self.size = identity.size
        self.address = 0  # (for __del__, should the mapping fail)
        # Mapped by the extension: Python's mmap would keep a duplicate descriptor per file.
        self.address = copier.map_file(fd, self.size) if self.size else 0
        self.last_used = 0.0

    def __del__(self) -> None:
        if self.address and _copier is not None:
            copier.unmap(self.address, self.size)


class FileMaps:
    """The process's file mappings, by path, each checked against the file before it is used."""

    def __init__(self, *, idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._maps: dict[str, _Mapping] = {}
        self._users = 0  # readers open now: nothing is dropped while one may copy
        self._timer: threading.Timer | None = None
        self.mapped = 0  # files mapped (a reused mapping is not counted again)

    def open(self, path: str) -> _Mapping:
        """``path``'s mapping; made anew when the file is not the one mapped (replaced, changed)."""
        with open(path, "rb") as file:  # OSError: missing, unreadable
            identity = _Identity.of(os.fstat(file.fileno()))
            with self._lock:
                current = self._maps.get(path)
                if current is not None and current.identity == identity:
                    current.last_used = self._clock()
                    return current
            fresh = _Mapping(path, identity, file.fileno())
        fresh.last_used = self._clock()
        with self._lock:
            self._maps[path] = fresh  # the one it replaces is unmapped with its last reference
            self.mapped += 1
        return fresh

    def enter(self) -> None:
        with self._lock:
            self._users += 1

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._arm()

    def paths(self) -> list[str]:
        with self._lock:
            return sorted(self._maps)

    def sweep(self) -> int:
        """Drop the mappings no load used for ``idle_s`` (none while a reader is open); how many."""
        with self._lock:
            if self._users:
                return 0
            now = self._clock()
            stale = [m for m in self._maps.values() if now - m.last_used >= self.idle_s]
            for m in stale:
                del self._maps[m.path]
        return len(stale)

    def _arm(self) -> None:
        # With the lock held: one timer at a time, only while mappings are kept and none is in use.
        if self._maps and not self._users and self._timer is None:
            self._timer = threading.Timer(self.idle_s, self._expire)
            self._timer.daemon = True
            self._timer.name = "streamer-file-maps"
            self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            self._timer = None
        self.sweep()
        with self._lock:
            self._arm()  # some were used since the timer was set


# A forked child has not the mappings' timer: it makes its own on first use (and its own copier
# pool: streamer_client._native_copier).
_MAPS: PerProcess[FileMaps] = PerProcess(FileMaps)


def file_maps() -> FileMaps:
    """The process's file mappings (made on first use)."""
    return _MAPS.get()


_pool = copier.pool


# --------------------------------------------------------------------------- the reader


class _Submission(NamedTuple):
    id: int
    files: tuple[FileReads, ...]
    keepalive: Any  # destination buffers and source mappings, until the copies are done
    ticket: int | None  # the copier's batch, None when no range needed copying
    copies: list[tuple[int, int]]  # (file index, range index) of each copy, in the batch's order
    errors: dict[tuple[int, int], StorageError]  # ranges failed before any copy


class MappedReader:
    """A :class:`~streamer_service.readers.base.Reader` over mapped local files.

    Submissions are answered in submission order, which is the order the pipeline waits in.
    Not thread-safe, like Run:ai's reader: one thread drives a reader (several readers may run at
    once; they share the process's copier and mappings).
    """

    def __init__(
        self,
        *,
        fs_strategy: str | None = None,
        environment: Mapping[str, str] | None = None,
        maps: FileMaps | None = None,
    ) -> None:
        del fs_strategy, environment  # Run:ai's knobs; nothing here reads them
        if _copier is None:
            raise StorageError("the native copier is not built; local files are read through Run:ai")
        self._maps = maps
        self._live: deque[_Submission] = deque()
        self._ready: deque[RangeResult] = deque()  # the answers of submissions done, not yet taken
        self._next_id = 0
        self._started = False

    def __enter__(self) -> MappedReader:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("MappedReader already started")
        if self._maps is None:
            self._maps = file_maps()
        self._maps.enter()
        self._started = True

    def close(self) -> None:
        """Wait for every copy still queued (their buffers may go only then), then let go."""
        if not self._started:
            return
        self._started = False
        try:
            for submission in self._live:
                if submission.ticket is not None:
                    _wait(submission.ticket)
        finally:
            self._live.clear()
            self._ready.clear()
            self._maps.leave()

    @property
    def outstanding(self) -> int:
        return len(self._ready) + sum(sum(len(f.ranges) for f in s.files) for s in self._live)

    def submit(self, files: Sequence[FileReads], keepalive: Any) -> int:
        if not self._started:
            raise RuntimeError("MappedReader is not started")
        files = tuple(f for f in files if f.ranges)
        if not files:
            raise ValueError("a submission needs at least one range")
        dsts, srcs, sizes = array("Q"), array("Q"), array("Q")
        copies: list[tuple[int, int]] = []
        errors: dict[tuple[int, int], StorageError] = {}
        sources = []
        for fi, file in enumerate(files):
            try:
                mapping = self._maps.open(file.path)
            except OSError as exc:
                for ri, read in enumerate(file.ranges):
                    errors[fi, ri] = unmappable(file.path, read, exc)
                continue
            sources.append(mapping)
            for ri, read in enumerate(file.ranges):
                if read.end > mapping.size:
                    errors[fi, ri] = shorter(file.path, read, mapping.size)
                    continue
                dsts.append(read.dst)
                srcs.append(mapping.address + read.offset)
                sizes.append(read.nbytes)
                copies.append((fi, ri))
        ticket = copier.submit(dsts, srcs, sizes) if copies else None
        submission = _Submission(self._next_id, files, (keepalive, sources), ticket, copies, errors)
        self._next_id += 1
        self._live.append(submission)
        return submission.id

    def answer(self, wait_s: float | None = None) -> RangeResult | None:
        """The next range's answer: a submission's answers come together once all its copies are
        done, in submission order. ``None`` when none is owed, or when the head submission's
        copies are not done within ``wait_s`` seconds (``None``: as long as they take)."""
        if not self._ready:
            if not self._live:
                return None
            submission = self._live[0]
            errors = dict(submission.errors)
            if submission.ticket is not None:
                failed = _wait(submission.ticket, wait_s)
                if failed is None:
                    return None
                if failed >= 0:
                    fi, ri = submission.copies[failed]
                    file = submission.files[fi]
                    read = file.ranges[ri]
                    errors[fi, ri] = cut_short(file.path, read)
            self._live.popleft()
            answers = [(fi, ri) for fi, file in enumerate(submission.files) for ri in range(len(file.ranges))]
            for n, (fi, ri) in enumerate(answers):
                file = submission.files[fi]
                self._ready.append(
                    RangeResult(submission.id, fi, ri, file.path, file.ranges[ri], n == len(answers) - 1, errors.get((fi, ri)))
                )
        return self._ready.popleft()

    def __repr__(self) -> str:
        return f"MappedReader({'open' if self._started else 'closed'}, {len(self._live)} submissions)"


_wait = copier.wait


# --------------------------------------------------------------------------- errors
# What every read of a mapped file fails with (this reader's and a staged device load's).


def unmappable(path: str, read: ReadRange, exc: OSError) -> StorageError:
    """The file could not be opened or mapped (missing, unreadable)."""
    return StorageError(f"{read.where(path)}: cannot open or map: {exc.strerror or exc}", uri=path)


def shorter(path: str, read: ReadRange, size: int) -> ObjectChangedError:
    """The range ends past the file's end (``size`` when mapped): nothing of it is copied."""
    return ObjectChangedError(
        f"{read.where(path)}: End of file: the file has {size} bytes, fewer than the checkpoint's header says", uri=path
    )


def cut_short(path: str, read: ReadRange) -> ObjectChangedError:
    """The file was cut short under its mapping while the range was copied (SIGBUS, caught)."""
    return ObjectChangedError(f"{read.where(path)}: the file was cut short while it was read", uri=path)
