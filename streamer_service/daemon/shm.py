"""Shared-memory segments: files in the shm dir, mapped by the daemon and by the ranks.

Each segment is a file ``streamer-<daemon pid>-<instance token>-<n>`` created
0600 in ``STREAMER_SHM_DIR`` (``/dev/shm`` or a Kubernetes memory ``emptyDir``
shared by the daemon and the inference containers). Run:ai writes ranges
straight into the daemon's mapping; ranks map the same file read-only.

We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks
or warns from the wrong process (docs/architecture.md). Segments are unlinked when their
session ends, and a daemon sweeps segments of dead daemons when it starts.

Each segment carries its owner's identity: the daemon that made it holds a shared ``flock`` on
it from before anyone else can see it until it unlinks it, and the kernel drops that lock when
the daemon dies, however it dies. A sweep removes a segment only while it holds the exclusive
lock on it, which no sweep gets while the segment's daemon lives: locks work across PID
namespaces on one filesystem (two pods sharing an ``emptyDir``), where the PID in a name says
nothing (every daemon is PID 1 of its container). A segment a sweep removed before its maker
locked it is made again (:meth:`Segment.__init__`).

Which of its segments someone else removed the daemon knows too (:meth:`SegmentStore.vanished`):
a rank could not map them, so the daemon is not ready while it holds one.

Every page of a segment is allocated when it is created (``posix_fallocate``, or
faulted in by several threads for a large one: :func:`_allocated`), so a shm
filesystem smaller than the budget fails with a clear error here instead of a
SIGBUS in whichever process first touches a missing page.

What a segment is used as (a ring slot, an oversized segment, a kept segment) and the budget
they share (:class:`ShmBudget`) are defined in docs/architecture.md, "Segments".

Huge pages: what backs the shm dir's files is :mod:`.pages`'s (:func:`~.pages.detect_pages`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer_client._segments import POPULATE_PIECE, map_shared, populate_shares, populates_piecewise
from streamer_client.errors import ConfigError

from .generations import TABLE_SUFFIX, Generations
from .pages import Pages, detect_pages

__all__ = ["SEGMENT_PREFIX", "Reservation", "Segment", "SegmentStore", "ShmBudget", "sweep_stale_segments"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "streamer-"
_NAME_RE = re.compile(r"^streamer-\d+-[0-9a-f]+(?:-\d+|\.generations)$")  # a segment, or a daemon's generations table


# Threads that make segments ahead of need (``SegmentStore.create_soon``). posix_fallocate zero-fills
# a segment and map_shared maps it on one thread; both let go of the GIL (map_shared populates through
# ctypes), so segments made side by side on a many-core host take the time of one and the daemon's
# other threads run meanwhile (the reads they overlap have cores of their own). Not
# more: where new memory is slow to come (a VM's memory growing), more threads share that rate and
# the segment the load needs next comes later.
CREATE_WORKERS = max(1, min(4, os.cpu_count() or 1))

# A segment of at least two FILL_SHARE is filled by as many threads as it has shares, at most
# FILL_THREADS (the thread making it among them): an oversized tensor's, which a load makes on its
# own thread when none of its size is idle, costs the zero-fill of one share instead of the whole.
# Ring slots and kept segments (at most the slot size) are made by one thread each, several side
# by side on the makers' threads.
FILL_SHARE = 256 * 2**20
FILL_THREADS = CREATE_WORKERS


class Segment:
    """One mapped segment file. ``address`` is where Run:ai may write ``nbytes``.

    Holds the file open with a shared ``flock`` until :meth:`close` (the module docstring)."""

    __slots__ = (
        "name", "path", "nbytes", "_mmap", "array", "address", "_fd", "inode", "closed", "_generations", "entry",
        "generation", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, name: str, path: Path, nbytes: int, mode: int = 0o600, pages: Pages | None = None,
        generations: Generations | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.path = path
        self.nbytes = nbytes
        self.closed = False
        fd = create_locked(path, mode)
        try:
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask
            self._mmap = _allocated(fd, path, nbytes, pages)
            self.inode = os.fstat(fd).st_ino
        except BaseException:
            os.unlink(path)  # whatever failed, no file is left behind: nothing maps it
            os.close(fd)
            raise
        self._fd = fd
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data
        # Its entry in the daemon's generations table (-1: none), and the generation its bytes are of.
        self._generations = generations
        self.generation = 0
        try:
            self.entry = generations.take() if generations is not None else -1
        except BaseException:
            self._generations = None
            self.close()
            raise

    def bump(self) -> int:
        """A new generation, before new bytes are written into the segment: a rank still holding
        a handle of the old one raises once it checks (:mod:`.generations`)."""
        if self._generations is not None:
            self.generation = self._generations.bump(self.entry)
        return self.generation

    def close(self) -> None:
        """Unlink and unmap. Ranks that still map the file keep their pages until they unmap."""
        self.unlink()
        generations, self._generations = self._generations, None
        if generations is not None:
            generations.give(self.entry)
        self.array = None
        with contextlib.suppress(BufferError):  # a view still exported: the map goes with it
            self._mmap.close()

    def unlink(self) -> None:
        """Remove the file and let go of its lock, leaving the mapping as it is: whatever still
        writes into it may, and its pages go when the last mapping does."""
        self.closed = True  # before the file goes: SegmentStore.vanished reads it after the file
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def vanished(self) -> bool:
        """Whether someone else removed or replaced this segment's file while it is in use."""
        try:
            gone = os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            gone = True
        return gone and not self.closed

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.nbytes})"


def create_locked(path: Path, mode: int) -> int:
    """``path`` created (it must not exist) and opened with a shared ``flock`` held: a sweep that
    took the exclusive lock first (it listed the file the instant it was made) removed it before
    it was ours, so it is made again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits for a sweep holding it to have unlinked it
            if os.fstat(fd).st_nlink:
                return fd
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.close(fd)
            raise
        os.close(fd)


def _allocated(fd: int, path: Path, nbytes: int, pages: Pages | None) -> mmap.mmap:
    """The segment file ``fd`` grown to ``nbytes``, every page of it allocated, zero-filled and
    mapped writable now: no write into it faults, and a full shm filesystem is a ``ConfigError``
    here instead of a SIGBUS in a writing thread. A segment of at least two :data:`FILL_SHARE` s
    (an oversized tensor's) is filled by :data:`FILL_THREADS` threads side by side, each faulting
    its share in (``MADV_POPULATE_WRITE``); any other is zero-filled by ``posix_fallocate`` and then
    mapped (:func:`~streamer_client._segments.map_shared`). hugetlbfs always goes the second way:
    its ``fallocate`` reserves the huge pages."""
    piece = max(POPULATE_PIECE, pages.size if pages else 0)
    threads = min(FILL_THREADS, nbytes // FILL_SHARE)
    if threads >= 2 and populates_piecewise() and not (pages is not None and pages.hugetlbfs):
        os.ftruncate(fd, nbytes)
        mapping = map_shared(fd, nbytes, writable=True, populate=False)
        try:
            _fill(mapping, nbytes, threads, piece)
            return mapping
        except OSError as exc:
            mapping.close()
            if exc.errno in (errno.EFAULT, errno.ENOSPC):  # a page the filesystem had no room for (its fault's SIGBUS)
                raise _no_room(path, nbytes) from None
            if exc.errno != errno.EINVAL:
                raise
            os.ftruncate(fd, 0)  # a kernel without MADV_POPULATE_WRITE: allocated the other way
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM) and pages is not None and pages.hugetlbfs:
            raise ConfigError(
                f"hugetlbfs shared-memory dir {path.parent} has no free {pages.size // 2**20} MiB pages "
                f"for a {nbytes}-byte segment (see HugePages_Free in /proc/meminfo): reserve more huge "
                "pages (vm.nr_hugepages, or larger hugepages-2Mi requests in Kubernetes) or lower "
                "STREAMER_SHM_BUDGET"
            ) from None
        if exc.errno in (errno.ENOSPC, errno.EFBIG):
            raise _no_room(path, nbytes) from None
        raise
    # Every page mapped now, in pieces (``map_shared``): Run:ai's threads write without a fault a page.
    return map_shared(fd, nbytes, writable=True, populate=True, piece=piece)


def _fill(mapping: mmap.mmap, nbytes: int, threads: int, piece: int) -> None:
    """Fault every page of ``mapping`` in for writing, ``threads`` contiguous shares side by side
    (the calling thread takes the first); the first share's error, or the first other one's."""
    view = np.frombuffer(mapping, dtype=np.uint8)
    address = view.ctypes.data
    del view  # an exported buffer would keep the mapping from closing
    populate_shares(address, nbytes, writable=True, threads=threads, helpers=_fillers(), piece=piece)


_FILLERS: ThreadPoolExecutor | None = None
_FILLERS_LOCK = threading.Lock()


def _fillers() -> ThreadPoolExecutor:
    """The threads that fill the shares of a large segment beside the thread making it."""
    global _FILLERS
    with _FILLERS_LOCK:
        if _FILLERS is None:
            _FILLERS = ThreadPoolExecutor(FILL_THREADS - 1, thread_name_prefix="segment-fill")
        return _FILLERS


def _no_room(path: Path, nbytes: int) -> ConfigError:
    return ConfigError(
        f"shared-memory dir {path.parent} has no room for a {nbytes}-byte segment: "
        "make the shm filesystem larger than STREAMER_SHM_BUDGET or lower the budget"
    )


@dataclass(frozen=True)
class Reservation:
    nbytes: int
    beyond_budget: bool  # the one oversized allocation allowed past the limit


class ShmBudget:
    """Daemon-wide accounting of segment bytes: at most ``limit``, plus one oversized segment."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.peak = 0
        self._beyond_out = False
        self._lock = threading.Lock()

    def try_take(self, nbytes: int, *, oversized: bool = False) -> Reservation | None:
        with self._lock:
            beyond = False
            if self.in_use + nbytes > self.limit:
                if not oversized or self._beyond_out:
                    return None
                beyond = self._beyond_out = True
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
            return Reservation(nbytes, beyond)

    def give_back(self, reservation: Reservation) -> None:
        with self._lock:
            self.in_use -= reservation.nbytes
            if reservation.beyond_budget:
                self._beyond_out = False


class SegmentStore:
    """Creates this daemon instance's segments, knows which of them someone else removed, and
    sweeps those of dead daemons."""

    def __init__(self, shm_dir: Path, mode: int = 0o600) -> None:
        self.shm_dir = Path(shm_dir)
        self.mode = mode
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shared-memory dir {self.shm_dir} does not exist (STREAMER_SHM_DIR / --shm-dir)")
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self.pages = detect_pages(self.shm_dir)
        # Not a segment's name: leftovers() lists segments only.
        self.generations = Generations(self.shm_dir, f"{self.prefix[:-1]}{TABLE_SUFFIX}", mode, create=create_locked)
        self._counter = 0
        self._lock = threading.Lock()
        self._makers: ThreadPoolExecutor | None = None
        self._made: weakref.WeakValueDictionary[str, Segment] = weakref.WeakValueDictionary()
        self._vanished: set[str] = set()  # reported already

    def open(self) -> list[str]:
        """Sweep the segments of daemons that are gone. Returns the names swept."""
        return sweep_stale_segments(self.shm_dir)

    def close(self) -> None:
        """Stop making segments; every segment made is in someone's hands once this returns."""
        with self._lock:
            makers, self._makers = self._makers, None
        if makers is not None:
            makers.shutdown(wait=True)
        self.generations.close()

    def abandon(self) -> list[str]:
        """Unlink every segment file of this instance and unmap none: what may still write into
        them (a native read that cannot be stopped) may, until the process exits and its mappings
        go with it. Returns the names unlinked."""
        self.close()
        with self._lock:
            made = list(self._made.values())
        for segment in made:
            segment.unlink()
        for path in self.leftovers():  # a segment still being made, not yet counted
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return sorted(s.name for s in made)

    def create(self, nbytes: int) -> Segment:
        """A new segment of at least ``nbytes``: whole huge pages where the dir has them (``pages.round``)."""
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}{self._counter}"
        segment = Segment(name, self.shm_dir / name, self.pages.round(nbytes), self.mode, self.pages, self.generations)
        with self._lock:
            self._made[name] = segment
        return segment

    def create_soon(self, nbytes: int) -> Future[Segment]:
        """:meth:`create` on one of ``CREATE_WORKERS`` threads; the future's result is the segment, or
        the same errors (a full dir is a ``ConfigError``). Whoever asked owns it: close it if unused."""
        with self._lock:
            if self._makers is None:
                self._makers = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="segment-maker")
            return self._makers.submit(self.create, nbytes)

    def vanished(self) -> list[str]:
        """This instance's segments in use whose file someone else removed (or replaced): ranks
        cannot map them, so every load handed one fails. Logged once each."""
        with self._lock:
            made = list(self._made.values())
        gone = sorted(s.name for s in made if s.vanished())
        with self._lock:
            new = [name for name in gone if name not in self._vanished]
            self._vanished.update(new)
        if new:
            log.error(
                "%d of this daemon's shared-memory segments were removed from %s by another process (%s): "
                "ranks cannot map them and loads handed them fail; restart the daemon, and give every daemon "
                "a shm dir of its own or let only daemons of this version share it",
                len(new), self.shm_dir, ", ".join(new[:4]) + (", ..." if len(new) > 4 else ""),
            )  # fmt: skip
        return gone

    def leftovers(self) -> list[Path]:
        """Segments of this instance still in the shm dir (tests assert none after a session)."""
        return sorted(self.shm_dir.glob(f"{self.prefix}*"))


def _try_flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def sweep_stale_segments(shm_dir: Path) -> list[str]:
    """Remove the segments in ``shm_dir`` whose daemon is gone (none holds its lock: the module
    docstring); return their names. A segment this user cannot open is left alone."""
    removed = []
    for path in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        if _NAME_RE.match(path.name) is None:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, another user's, or not a file
        try:
            if not _try_flock(fd, fcntl.LOCK_EX):
                continue  # its daemon lives
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # while locked: a daemon making this name waits, then makes it again
                removed.append(path.name)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d shared-memory segments left by a dead daemon in %s", len(removed), shm_dir)
    return removed
