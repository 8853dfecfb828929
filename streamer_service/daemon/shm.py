"""Shared-memory segments: files in the shm dir, mapped by the daemon and by the ranks.

Each segment is a file ``streamer-<daemon pid>-<instance token>-<n>`` created
0600 in ``STREAMER_SHM_DIR`` (``/dev/shm`` or a Kubernetes memory ``emptyDir``
shared by the daemon and the inference containers). Run:ai writes ranges
straight into the daemon's mapping; ranks map the same file read-only.

We do not use ``multiprocessing.shared_memory``: its resource tracker unlinks
or warns from the wrong process (docs/architecture.md). Segments are unlinked when their
session ends, and a daemon sweeps segments of dead daemons when it starts.

Whether the daemons that made segments are alive is decided by a lock, not by
the PID in a segment's name: a PID says nothing in a container, where every
daemon is PID 1 of its own namespace. Each daemon holds a shared
``flock`` on the shm dir itself for its whole life; the kernel drops it when
the process dies, however it dies. A starting daemon that gets the exclusive
lock knows no other daemon uses the dir, so every segment there is stale. (Only
where another daemon shares the dir does it fall back to the PIDs.)

Every page of a segment is allocated when it is created (``posix_fallocate``, or
faulted in by several threads for a large one: :func:`_allocated`), so a shm
filesystem smaller than the budget fails with a clear error here instead of a
SIGBUS in whichever process first touches a missing page.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamer_client.errors import ConfigError
from streamer_client.segments import POPULATE_PIECE, map_shared, populate_shares, populates_piecewise

from .generations import TABLE_SUFFIX, Generations
from .pages import Pages, detect_pages

__all__ = ["SEGMENT_PREFIX", "Reservation", "Segment", "SegmentStore", "ShmBudget", "sweep_stale_segments"]

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "streamer-"
# A segment, or a daemon's generations table (.generations).
_NAME_RE = re.compile(r"^streamer-(\d+)-[0-9a-f]+(?:-\d+|\.generations)$")


# Threads that make segments ahead of need (``SegmentStore.create_soon``). posix_fallocate zero-fills
# a segment and map_shared maps it on one thread; both let go of the GIL (map_shared populates through
# ctypes), so segments made side by side on a many-core host take the time of one and the daemon's
# other threads run meanwhile (the reads they overlap have cores of their own). Not
# more: where new memory is slow to come (a VM's memory growing), more threads share that rate and
# the segment the load needs next comes later (8 threads: 0.60 s of a 4.3 GB retained load waiting
# for segments on an H200 VM, 4 threads: 0.40 s).
CREATE_WORKERS = max(1, min(4, os.cpu_count() or 1))

# A segment of at least two FILL_SHARE is filled by as many threads as it has shares, at most
# FILL_THREADS (the thread making it among them): an oversized tensor's, which a load makes on its
# own thread when none of its size is idle, costs the zero-fill of one share instead of the whole.
# Ring slots and kept segments (at most the slot size) are made by one thread each, several side
# by side on the makers' threads.
FILL_SHARE = 256 * 2**20
FILL_THREADS = CREATE_WORKERS


class Segment:
    """One mapped segment file. ``address`` is where Run:ai may write ``nbytes``."""

    __slots__ = ("name", "path", "nbytes", "_mmap", "array", "address", "_generations", "entry", "generation")

    def __init__(
        self, name: str, path: Path, nbytes: int, mode: int = 0o600, pages: Pages | None = None,
        generations: Generations | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.path = path
        self.nbytes = nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # exactly this mode, whatever the umask
            self._mmap = _allocated(fd, path, nbytes, pages)
        except BaseException:
            os.unlink(path)  # whatever failed, no file is left behind: nothing maps it
            raise
        finally:
            os.close(fd)
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        generations, self._generations = self._generations, None
        if generations is not None:
            generations.give(self.entry)
        self.array = None
        with contextlib.suppress(BufferError):  # a view still exported: the map goes with it
            self._mmap.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.nbytes})"


def _allocated(fd: int, path: Path, nbytes: int, pages: Pages | None) -> mmap.mmap:
    """The segment file ``fd`` grown to ``nbytes``, every page of it allocated, zero-filled and
    mapped writable now: no write into it faults, and a full shm filesystem is a ``ConfigError``
    here instead of a SIGBUS in a writing thread. A segment of at least two :data:`FILL_SHARE` s
    (an oversized tensor's) is filled by :data:`FILL_THREADS` threads side by side, each faulting
    its share in (``MADV_POPULATE_WRITE``); any other is zero-filled by ``posix_fallocate`` and then
    mapped (:func:`~streamer_client.segments.map_shared`). hugetlbfs always goes the second way:
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
    """Creates this daemon instance's segments; knows how to sweep those of dead daemons."""

    def __init__(self, shm_dir: Path, mode: int = 0o600) -> None:
        self.shm_dir = Path(shm_dir)
        self.mode = mode
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shared-memory dir {self.shm_dir} does not exist (STREAMER_SHM_DIR / --shm-dir)")
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self.pages = detect_pages(self.shm_dir)
        # Not a segment's name: leftovers() lists segments only.
        self.generations = Generations(self.shm_dir, f"{self.prefix[:-1]}{TABLE_SUFFIX}", mode)
        self._counter = 0
        self._lock = threading.Lock()
        self._dir_fd: int | None = None
        self._makers: ThreadPoolExecutor | None = None

    def open(self) -> list[str]:
        """Sweep the segments of daemons that are gone, then mark the dir as used by this one
        (until :meth:`close` or death). Returns the names swept."""
        fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            alone = _try_flock(fd, fcntl.LOCK_EX)
            removed = sweep_stale_segments(self.shm_dir, everything=alone)
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while another daemon sweeps
        except BaseException:
            os.close(fd)
            raise
        self._dir_fd = fd
        return removed

    def close(self) -> None:
        """This daemon no longer uses the dir (its segments are gone)."""
        with self._lock:
            makers, self._makers = self._makers, None
        if makers is not None:
            makers.shutdown(wait=True)  # every segment made is in someone's hands before we go
        self.generations.close()
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            os.close(fd)

    def create(self, nbytes: int) -> Segment:
        """A new segment of at least ``nbytes``: whole huge pages where the dir has them (``pages.round``)."""
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}{self._counter}"
        return Segment(name, self.shm_dir / name, self.pages.round(nbytes), self.mode, self.pages, self.generations)

    def create_soon(self, nbytes: int) -> Future[Segment]:
        """:meth:`create` on one of ``CREATE_WORKERS`` threads; the future's result is the segment, or
        the same errors (a full dir is a ``ConfigError``). Whoever asked owns it: close it if unused."""
        with self._lock:
            if self._makers is None:
                self._makers = ThreadPoolExecutor(CREATE_WORKERS, thread_name_prefix="segment-maker")
            return self._makers.submit(self.create, nbytes)

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(shm_dir: Path, *, everything: bool = False) -> list[str]:
    """Remove segments of daemons that are gone; return their names. ``everything``: the caller
    holds the dir's exclusive lock, so no daemon that made them is alive (see the module docstring);
    otherwise only segments whose daemon's PID is gone from this PID namespace."""
    removed = []
    for path in Path(shm_dir).glob(f"{SEGMENT_PREFIX}*"):
        match = _NAME_RE.match(path.name)
        if match is None or (not everything and _alive(int(match.group(1)))):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory segments left by a dead daemon in %s", len(removed), shm_dir)
    return removed
